"""JSON Schemas the structured-output tests constrain generation with, and validate every
reply against (``jsonschema``): nesting, arrays, enums, bounded numbers, ``required``,
``anyOf``, string patterns. ``HELD_OUT`` were written after the engine worked and never
tuned against: the same checks, schemas the development never saw."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

SCHEMAS: dict[str, Schema] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,20}\\.[a-z]{2,4}$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "nested_order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "vip": {"type": "boolean"},
                },
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    },
                    "required": ["sku", "quantity", "price"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "customer", "items"],
        "additionalProperties": False,
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "weather": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
            "temperatures": {
                "type": "array",
                "items": {"type": "number", "minimum": -50, "maximum": 60},
                "minItems": 2,
                "maxItems": 5,
            },
        },
        "required": ["weather", "temperatures"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "result": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "ok": {"const": True},
                            # Bounded: a base model's greedy digits can run on for ever.
                            "value": {"type": "integer", "minimum": -1000, "maximum": 1000},
                        },
                        "required": ["ok", "value"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "ok": {"const": False},
                            "error": {"type": "string", "maxLength": 30},
                        },
                        "required": ["ok", "error"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["result"],
        "additionalProperties": False,
    },
    "defs_and_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "number", "minimum": -10, "maximum": 10},
                    "y": {"type": "number", "minimum": -10, "maximum": 10},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
}

HELD_OUT: dict[str, Schema] = {
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "genres": {
                "type": "array",
                "items": {"enum": ["fiction", "history", "science", "poetry"]},
                "maxItems": 2,
            },
            "isbn": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{10}$"},
        },
        "required": ["title", "year", "genres", "isbn"],
        "additionalProperties": False,
    },
    "sensor_reading": {
        "type": "object",
        "properties": {
            "sensor": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "status": {"anyOf": [{"enum": ["ok", "degraded"]}, {"type": "null"}]},
            "readings": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "t": {"type": "integer", "minimum": 0, "maximum": 86400},
                        "value": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    "required": ["t", "value"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["sensor", "status", "readings"],
        "additionalProperties": False,
    },
    "calendar_event": {
        "type": "object",
        "properties": {
            "summary": {"type": "string", "maxLength": 50},
            "attendees": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "string", "maxLength": 20},
            },
            "duration_minutes": {"type": "integer", "enum": [15, 30, 45, 60]},
            "location": {
                "type": "object",
                "properties": {
                    "room": {"type": "string", "maxLength": 20},
                    "floor": {"type": "integer", "minimum": 0, "maximum": 40},
                },
                "required": ["room"],
                "additionalProperties": False,
            },
        },
        "required": ["summary", "attendees", "duration_minutes", "location"],
        "additionalProperties": False,
    },
}

#: A prompt that asks for each schema's kind of object.
PROMPTS: dict[str, str] = {
    "person": "Describe a person as JSON with their name, age and email.",
    "nested_order": "Write a shop order as JSON: an id, the customer and the items bought.",
    "enum_and_array": "Give today's weather and a few temperatures as JSON.",
    "any_of": "Report the result of adding 2 and 3 as JSON.",
    "defs_and_refs": "Give a line segment's start and end points as JSON.",
    "book": "Describe a famous book as JSON.",
    "sensor_reading": "Write a sensor's status and its recent readings as JSON.",
    "calendar_event": "Plan a short team meeting as JSON.",
}

ALL: dict[str, Schema] = {**SCHEMAS, **HELD_OUT}
