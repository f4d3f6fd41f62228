"""The local executions service over gRPC: what ``google.cloud.workflows.executions_v1.ExecutionsClient``
speaks (its only transport is gRPC).

A generic handler serves ``google.cloud.workflows.executions.v1.Executions`` with the package's own
request and response types (their ``deserialize`` / ``serialize``), so the real client talks to the
local :class:`~cloudworkflows.server.ExecutionsServer` exactly as to workflowexecutions.googleapis.com.
The REST side stays: callbacks are plain HTTP POSTs to URLs the executions hand out.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import TYPE_CHECKING, Any

import grpc
from google.cloud.workflows.executions_v1 import types

if TYPE_CHECKING:
    from cloudworkflows.server import ExecutionsServer

SERVICE = "google.cloud.workflows.executions.v1.Executions"


def execution(resource: dict[str, Any]) -> types.Execution:
    """The REST resource of an execution as the API's message."""
    out = types.Execution(
        name=resource["name"],
        state=getattr(types.Execution.State, resource["state"]),
        argument=resource.get("argument", ""),
        result=resource.get("result") or "",
        workflow_revision_id=resource.get("workflowRevisionId", ""),
    )
    for field, key in (("start_time", "startTime"), ("end_time", "endTime")):
        if resource.get(key):
            setattr(out, field, datetime.fromisoformat(resource[key].replace("Z", "+00:00")))
    if resource.get("error"):
        out.error = types.Execution.Error(
            payload=resource["error"]["payload"], context=resource["error"]["context"]
        )
    return out


def _handlers(server: ExecutionsServer) -> grpc.GenericRpcHandler:
    def guarded(
        fn: Callable[[Any, grpc.ServicerContext], Any], permission: str
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if server.authorize is not None:
                token = next(
                    (v for k, v in context.invocation_metadata() if k == "authorization"), ""
                ).removeprefix("Bearer ")
                name = getattr(request, "parent", "") or getattr(request, "name", "")
                refusal = server.refusal(token or None, permission, name)
                if refusal is not None:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            try:
                return fn(request, context)
            except KeyError as e:
                context.abort(grpc.StatusCode.NOT_FOUND, f"execution {e.args[0]} not found")
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return call

    def create(request: types.CreateExecutionRequest, _: grpc.ServicerContext) -> types.Execution:
        return execution(server.create(request.parent, request.execution.argument))

    def get(request: types.GetExecutionRequest, _: grpc.ServicerContext) -> types.Execution:
        return execution(server.get(request.name))

    def cancel(request: types.CancelExecutionRequest, _: grpc.ServicerContext) -> types.Execution:
        return execution(server.cancel(request.name))

    def list_(request: types.ListExecutionsRequest, _: grpc.ServicerContext) -> types.ListExecutionsResponse:
        return types.ListExecutionsResponse(executions=[execution(r) for r in server.list(request.parent)])

    def unary(fn: Callable[..., Any], request: Any, response: Any, permission: str) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            guarded(fn, permission),
            request_deserializer=request.deserialize,
            response_serializer=response.serialize,
        )

    executions = "workflows.executions."
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "CreateExecution": unary(
                create, types.CreateExecutionRequest, types.Execution, executions + "create"
            ),
            "GetExecution": unary(get, types.GetExecutionRequest, types.Execution, executions + "get"),
            "CancelExecution": unary(
                cancel, types.CancelExecutionRequest, types.Execution, executions + "cancel"
            ),
            "ListExecutions": unary(
                list_, types.ListExecutionsRequest, types.ListExecutionsResponse, executions + "list"
            ),
        },
    )


def serve(server: ExecutionsServer, host: str = "127.0.0.1") -> tuple[grpc.Server, str]:
    """Start the gRPC side of ``server``; the running server and its ``host:port`` target."""
    grpc_server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="executions-grpc"))
    grpc_server.add_generic_rpc_handlers((_handlers(server),))
    port = grpc_server.add_insecure_port(f"{host}:0")
    grpc_server.start()
    return grpc_server, f"{host}:{port}"
