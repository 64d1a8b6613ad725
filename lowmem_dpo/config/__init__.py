"""One typed config, validated at load, from a YAML recipe and key=value overrides:

    coerce.py    YAML values and key=value strings into declared types (null handling, bounds): pure
    sources.py   the `dataset` key's sources (path, split, fraction, rows) and their coercion
    schedule.py  the learning-rate schedule: transformers' get_scheduler, its warmup read as transformers reads it
    schema.py    Config: every key, its doc and bounds, and what changing it changes (reference="value" or
                 "files", resumable)
    checks.py    the checks across keys (Config.validate, Config.no_effect)
    recipe.py    a recipe file + overrides into one validated Config (load_config, build_config)
    cli.py       the stages' `python -m` entry: --help from the keys' docs, exit codes (2 for bad input)

Its face: schema.Config and recipe.load_config; a stage's main() goes through cli.run_cli.
"""
