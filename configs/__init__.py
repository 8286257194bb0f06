"""ml_collections configs: each file's get_config() returns a ConfigDict."""
