"""Bytes and files: local and object-storage paths, atomic writes, Parquet shards with their manifests and metadata,
and the names of a run folder (layout). The bottom layer: imports nothing else from pipeline."""
