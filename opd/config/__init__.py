"""Configuration: the schema of every setting, the YAML loader and the preset files."""
