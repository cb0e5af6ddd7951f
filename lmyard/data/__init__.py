"""Text to token shards: sources, tokenizers, tokenize-and-shard, the shard format, the trainer's loader."""
