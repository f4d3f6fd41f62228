"""The ledger on Firestore: arrivals, batches, snapshots and run records.

Layout (one collection per concept):
  datasets/{dataset}                          the live run, the champion (the checkpoint runs continue from)
  datasets/{dataset}/promotions/{run_id}      one per promotion: the new champion and the one it replaced
  datasets/{dataset}/arrivalsNN/{sha1(b/n#g)} one per object version (NN: one of ARRIVAL_SHARDS shards)
  datasets/{dataset}/contents/{sha1(hash)}    one per content hash: the run that trains (or trained) it
  batches/{batch_id}                          a sealed window of arrivals, and what became of it
  runs/{run_id}                               the run record
  watermarks/{sha1(table)}                    how far a watched BigQuery table has been exported

Coalescing: a dataset has at most one live run and one pending run.  A seal puts the content hashes
of its batch that no run holds yet into ``contents/`` under the pending run (creating it when there is
none); content some run already holds (trained, live or pending) adds nothing, so identical bytes under
any name, in any grouping, train once.  A seal that brings nothing new makes no run.  The pending run's
object list is fixed when it starts: every ``contents/`` entry naming it.  Each entry is written in a
transaction that checks the run is still the dataset's pending run, and starting a run clears that in
a write conditioned on the same document's update time, so no entry can join a run after its list was
read.

Arrivals are sharded (``arrivals00`` .. ``arrivals15`` by the first byte of their key): "If a
collection contains documents with sequential indexed values, Cloud Firestore limits the write rate to
500 writes per second" (firebase.google.com/docs/firestore/solutions/shard-timestamp), and
``arrived_at`` is such a value; as separate collections each shard keeps its automatic single-field
index, so a dataset sustains ARRIVAL_SHARDS x 500 = 8,000 arrivals/s with no composite index to deploy.

Storm-proof by construction: recording an arrival is one commit that *creates* one document keyed
by the object version's identity (bucket, name, generation) and touches nothing shared, so a burst of
arrivals never contends on a hot document.  A redelivered event names the same object version (a
finalize event's id is per object version), so it fails the create exactly like the same version
announced under another event id: both are duplicates, with no second document to write.

An arrival's batch is decided by time, not by a pointer: each arrival carries its commit timestamp,
and a seal cuts the dataset's timeline at its own commit timestamp, so batch k is exactly the arrivals
committed in (cut[k-1], cut[k]] -- every arrival lands in one batch, whatever the interleaving.
The client honours FIRESTORE_EMULATOR_HOST, so the emulator and the cloud differ only by endpoint.
"""

from __future__ import annotations

from retrain.adapters.ledger.arrivals import ArrivalRecords
from retrain.adapters.ledger.base import FirestoreBase
from retrain.adapters.ledger.batches import BatchRecords
from retrain.adapters.ledger.exports import ExportRecords
from retrain.adapters.ledger.holdings import HoldingRecords
from retrain.adapters.ledger.runs import RunRecords

__all__ = ["FirestoreLedger"]


class FirestoreLedger(ArrivalRecords, BatchRecords, HoldingRecords, ExportRecords, RunRecords, FirestoreBase):
    """:class:`retrain.ports.Ledger` on Firestore (native mode), a module per part of the layout: arrivals,
    batches, holdings, exports and runs, over the references and reads they share (:mod:`.base`)."""
