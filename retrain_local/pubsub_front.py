"""Pub/Sub's permission check, in front of the Pub/Sub emulator, for what retrain's processes publish.

Each identity's processes get their own ``PUBSUB_EMULATOR_HOST`` (:meth:`PubSubFront.endpoint`);
a ``Publish`` arriving there needs ``pubsub.topics.publish`` on its topic, the permission Google lists
for it (cloud.google.com/pubsub/docs/access-control: "pubsub.topics.publish", in
``roles/pubsub.publisher``).  A refused call fails as Pub/Sub fails it, ``PERMISSION_DENIED`` ("User
not authorized to perform this action."), with who lacked what appended.  Nothing else is relayed: the
functions only publish (the run events of :class:`retrain.adapters.events.PubSubRunEvents`).
"""

from __future__ import annotations

from retrain_local.grpc_front import GrpcFront
from retrain_local.iam import Kind, Resource


class PubSubFront(GrpcFront):
    SERVICE = "/google.pubsub.v1.Publisher/"

    def needed(self, method: str, request: bytes) -> list[tuple[str, Resource]]:
        if method != "Publish":
            raise KeyError(method)
        from google.pubsub_v1.types import PublishRequest

        topic = PublishRequest.deserialize(request).topic
        return [("pubsub.topics.publish", Resource(Kind.TOPIC, topic.rsplit("/", 1)[-1]))]

    def refusal(self, reason: str) -> str:
        return f"User not authorized to perform this action. ({reason})"
