"""The stand-in's work on machines without PyTorch: check a run's data instead of training on it.

Every dataset of the blend is read and checked as a strict reader would (magic, version, dtype,
pointers, .bin size, document indices); documents and tokens are counted.  A bad dataset raises
DataError naming it.
"""

from __future__ import annotations

from typing import Any

from retrain_local.train.data import DataError, load_blend


def check(data_prefix: list[Any]) -> dict[str, Any]:
    """The metrics of a blend whose every dataset reads back; raises DataError otherwise."""
    blend = load_blend(data_prefix)
    try:
        per = []
        for d in blend.datasets:
            if d.weight > 0 and d.data.tokens == 0:
                raise DataError("has no tokens but a weight > 0", d.prefix)
            per.append(
                {
                    "prefix": d.prefix,
                    "weight": d.weight,
                    "dtype": str(d.data.dtype.__name__),
                    "sequences": len(d.data),
                    "documents": d.data.documents,
                    "tokens": d.data.tokens,
                    "max_token_id": int(d.tokens.max()) if d.tokens.size else None,
                }
            )
        return {
            "trainer": "datacheck",
            "documents": blend.documents,
            "tokens": blend.tokens,
            "datasets": len(blend.datasets),
            "blend": per,
            "max_token_id": blend.max_token_id(),
            "checkpoint": None,
        }
    finally:
        blend.close()
