//! Embeds the Lean oracle modules (`lean/**/*.lean`, hidden directories skipped) into the
//! crate as `(relative path, text)` pairs, so the Python extension carries the exact text
//! its oracle parity check reads: an installed wheel needs no data files and the
//! repository keeps one copy, `lean/`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::{env, fs};

fn lean_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        if path.is_dir() {
            lean_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "lean") {
            out.push(path);
        }
    }
}

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("lean");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut files = Vec::new();
    lean_files(&root, &mut files);
    assert!(!files.is_empty(), "no .lean files under {}", root.display());
    let mut code = String::from("/// `(path relative to lean/, text)` of every Lean module.\n");
    code.push_str("pub const LEAN_MODULES: &[(&str, &str)] = &[\n");
    for path in &files {
        let relative = path.strip_prefix(&root).expect("under lean/");
        let relative = relative
            .components()
            .map(|c| c.as_os_str().to_str().expect("UTF-8 path"))
            .collect::<Vec<_>>()
            .join("/");
        writeln!(
            code,
            "    ({relative:?}, include_str!({:?})),",
            path.display().to_string()
        )
        .expect("writing to a String");
    }
    code.push_str("];\n");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets it")).join("lean_modules.rs");
    fs::write(out, code).expect("writing OUT_DIR/lean_modules.rs");
}
