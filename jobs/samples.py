"""`n` samples per item (OpenAI's `n`): each sample is its own sequence in the broker, with its own seed, and
the item is recorded once all of its samples have finished.

- Seeds: sample 0 samples with the item's seed (its own `seed`, or the one derived from the job seed and its
  position), so an item with n=1 and the first sample of any n give exactly what a job without `n` gives;
  sample k >= 1 with `sample_seed(seed, custom_id, k)`, a pure function of the three.
- Request ids: an item's one sequence keeps the item's id ("17"); with n > 1, sample k is "17/k".
- The store keeps sample 0 in the item's own columns (output, finish_reason, logprobs), the completion
  tokens of every sample summed, and every sample in the item's `samples` column (JSON, only when n > 1);
  result rows are one per sample, with `sample_index`.

Light on purpose (imports neither SQLAlchemy nor torch): the job runner and the planner's workload use it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from layerbus.storage.result_row import SAMPLE_FIELDS, expand_samples  # noqa: F401 (expand_samples: re-exported)

# The key of an item's params and of a job's settings.extra that gives its samples per item.
N_KEY = "n"


def samples_of(params: Mapping[str, Any], job_extra: Mapping[str, Any]) -> int:
    """An item's samples: its own n, else the job's (`--n`), else 1."""
    return int(params.get(N_KEY, job_extra.get(N_KEY, 1)))


def sample_seed(seed: int, custom_id: str, index: int) -> int:
    """The seed of sample `index` of the item `custom_id` whose seed is `seed`: the seed itself for sample 0,
    else a hash of all three (in [0, 2**63), as seeds are), so samples differ from each other and from other
    items' samples, and are the same on every rerun, on any broker."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{custom_id}:{index}".encode(), digest_size=8, person=b"layerbus-n").digest()
    return int.from_bytes(digest, "big") >> 1


def sample_request_id(item_id: int, index: int, n: int) -> str:
    """The broker's request id of one sample: the item's id alone when it has one sample."""
    return str(item_id) if n == 1 else f"{item_id}/{index}"


def parse_request_id(request_id: str) -> tuple[int, int]:
    """(item id, sample index) of a request id made by sample_request_id."""
    item, _, index = request_id.partition("/")
    return int(item), int(index or 0)


def samples_json(samples: list[dict[str, Any]]) -> str:
    """The store's samples column: each sample's SAMPLE_FIELDS, in sample order."""
    return json.dumps([{name: sample.get(name) for name in SAMPLE_FIELDS} for sample in samples],
                      ensure_ascii=False)
