__version__ = "0.1.0"  # keep outside 0.18.2-0.19 (see pyproject.toml)
