//! Bounded fraction digits for JSON Schema `number`s.
//!
//! JSON Schema cannot bound how many digits a number has, and llguidance's number lexeme
//! allows any count: a small greedy model can write `12.5000000…` until its token budget
//! is gone, and the reply never parses. llama.cpp's schema converter bounds fraction digits
//! (`[0-9]{1,16}`); we do the same through the one bound llguidance compiles into its
//! number lexeme, `multipleOf: 1e-N`. It only tightens the grammar: every output still
//! validates against the schema as written, and the schema the client sent is not changed.
//! Numbers are then written as decimals (no exponent, as llguidance already writes bounded
//! ones).

use serde_json::{Map, Value};

/// The most fraction digits a constrained `number` is written with. llguidance reads
/// `multipleOf` through an `f64` and a `u32` coefficient, and its digit automaton computes
/// `9 · 10^N` in a `u32`: 8 is the largest N exact in all three.
pub const MAX_FRACTION_DIGITS: i32 = 8;

/// Keywords whose value is one subschema.
const ONE_SCHEMA: &[&str] = &[
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
];
/// Keywords whose value is an array of subschemas (`allOf` is handled apart).
const SCHEMA_ARRAYS: &[&str] = &["anyOf", "oneOf", "prefixItems", "items"];
/// Keywords whose value maps names to subschemas.
const SCHEMA_MAPS: &[&str] = &[
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];

/// Adds `multipleOf: 1e-MAX_FRACTION_DIGITS` to every `number` subschema of `schema` that
/// has no `multipleOf`, `enum` or `const` of its own and whose bounds are written within
/// that many digits. `not` subschemas are left alone (tightening them would loosen the
/// schema), as are `allOf` lists that state a `multipleOf` (llguidance merges those).
pub fn bound_fraction_digits(schema: &mut Value) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    if is_unbounded_number(object) {
        let step = 10f64.powi(-MAX_FRACTION_DIGITS);
        object.insert("multipleOf".into(), Value::from(step));
    }
    for (key, value) in object.iter_mut() {
        let key = key.as_str();
        if ONE_SCHEMA.contains(&key) {
            bound_fraction_digits(value);
        }
        if SCHEMA_ARRAYS.contains(&key)
            || (key == "allOf" && !value.to_string().contains("\"multipleOf\""))
        {
            value
                .as_array_mut()
                .into_iter()
                .flatten()
                .for_each(bound_fraction_digits);
        }
        if SCHEMA_MAPS.contains(&key) {
            value
                .as_object_mut()
                .into_iter()
                .flat_map(|m| m.values_mut())
                .for_each(bound_fraction_digits);
        }
    }
}

fn is_unbounded_number(object: &Map<String, Value>) -> bool {
    let number = match object.get("type") {
        Some(Value::String(t)) => t == "number",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "number"),
        _ => false,
    };
    let scale = 10f64.powi(MAX_FRACTION_DIGITS);
    let bounds_fit = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]
        .iter()
        .filter_map(|k| object.get(*k).and_then(Value::as_f64))
        .all(|b| (b * scale).fract() == 0.0);
    number
        && bounds_fit
        && !["multipleOf", "enum", "const"]
            .iter()
            .any(|k| object.contains_key(*k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_get_a_step_where_nothing_bounds_them_already() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "n": {"type": "integer"},
                "stepped": {"type": "number", "multipleOf": 0.5},
                "fixed": {"type": "number", "const": 1.5},
                "fine": {"type": "number", "minimum": 0.123456789},
                "either": {"type": ["number", "null"]},
                "list": {"type": "array", "items": {"type": "number"}},
                "not": {"not": {"type": "number"}},
            },
            "anyOf": [{"type": "number"}],
            "$defs": {"p": {"type": "number"}},
            "allOf": [{"type": "number"}, {"multipleOf": 3}],
        });
        bound_fraction_digits(&mut s);
        let step = |v: &Value| v.get("multipleOf").and_then(Value::as_f64);
        let p = &s["properties"];
        assert_eq!(step(&p["price"]), Some(1e-8));
        assert_eq!(step(&p["either"]), Some(1e-8));
        assert_eq!(step(&p["list"]["items"]), Some(1e-8));
        assert_eq!(step(&s["anyOf"][0]), Some(1e-8));
        assert_eq!(step(&s["$defs"]["p"]), Some(1e-8));
        assert_eq!(step(&p["n"]), None);
        assert_eq!(step(&p["stepped"]), Some(0.5));
        assert_eq!(step(&p["fixed"]), None);
        assert_eq!(step(&p["fine"]), None);
        assert_eq!(step(&p["not"]["not"]), None);
        assert_eq!(step(&s["allOf"][0]), None);
    }
}
