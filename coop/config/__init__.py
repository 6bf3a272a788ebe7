"""The config layer: what a run is, before anything is built.

load.py (YAML files and `key=value` overrides into one checked config), schema.py (the typed
schema: every key's type, default, set or range), spec.py (reading those declarations),
checks.py (the rules between keys), recipes.py (each method's and each dataset's recipe),
run_names.py (run folder names).

The bottom layer: imports nothing from coop. Imported by every other layer and the tools.
"""
