//! What the volume benches share: reading this run's medians back from criterion.

use std::path::PathBuf;
use std::time::SystemTime;

/// Median time (ns) of the benchmark at `id` (its path under criterion's output: group,
/// function and, for parameterised ones, the parameter) if this run measured it.
pub fn median_ns(id: &[&str], since: SystemTime) -> Option<f64> {
    let root = std::env::var_os("CRITERION_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR").map(|d| PathBuf::from(d).join("criterion"))
        })
        .unwrap_or_else(|| PathBuf::from("target/criterion"));
    let path = id
        .iter()
        .fold(root, |p, part| p.join(part))
        .join("new/estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < since {
        return None; // stale: this run did not measure it (filtered out)
    }
    let json = std::fs::read_to_string(path).ok()?;
    let median = &json[json.find("\"median\"")?..];
    let value = &median[median.find("\"point_estimate\":")? + "\"point_estimate\":".len()..];
    let end = value.find([',', '}'])?;
    value[..end].trim().parse().ok()
}
