"""Every training knob defined once (fields.py: types, bounds, help texts, field groups) and named registries."""
