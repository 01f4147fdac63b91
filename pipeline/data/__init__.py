"""The datasets the pipeline reads and hands to other teams: prompt sources, chat formatting, the versioned
Parquet schemas and cards, and validation. Imports pipeline.io, pipeline.policy and pipeline.runtime."""
