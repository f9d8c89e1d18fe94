"""Jobs: programs that run decodes to produce a measurement or an artifact (`python -m specvocab.engine.jobs.<job>`).

The decoder library (`engine`) never imports this package; each job imports the library."""
