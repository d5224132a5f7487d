"""The user's images: checked file by file before a run (check), and staged in flux-train's cache so that sd-scripts
never writes beside them (stage)."""
