"""Datasets: corpora read as documents, the tokenizer, and prepared datasets (token shards and their index).

No training and no networking here: ``train/`` reads what this package prepares, and the peer fetches it.
"""
