"""Everything that knows sd-scripts: flag names, TOML, the pinned commit, the parser schema, the runner."""
