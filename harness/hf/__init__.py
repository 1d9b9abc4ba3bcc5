"""Hugging Face directories on disk: reading model.init_from's (checkpoint.py), starting a run from it (init_from.py),
recording what an export keeps of it (source.py) and writing the export (export.py). The mappings they apply are
model/hf/'s."""
