"""The one door to Flower's internals: every name edgefl takes from flwr beyond its public API (``flwr.app``,
``flwr.clientapp``, ``flwr.serverapp``, ``flwr.serverapp.strategy``, ``flwr.simulation``, ``flwr.common``) comes
from here, and so does every check of the code edgefl relies on. No other module imports flwr's internals
(``tests/test_flower_door.py`` reads them all).

- ``FLWR_CHECKED``: the flwr versions whose code was read when the tables below were written.
- ``INTERNAL``: each internal name edgefl uses, by the module it comes from. A name is imported when it is first
  taken from this module (``from contract.flower import HeartbeatSender``), so a process pays only for the
  internals it uses (the Runtime API client's modules import FastAPI: a second per process); a name the
  installed flwr does not have is refused in one line naming its version and the checked ones (``EdgeflError``).
- The source digests (sha256 of ``inspect.getsource``, first 16 hex digits) of the code whose behaviour edgefl
  relies on, one table per use, compared with the installed flwr's before the use (``why_differs``):

  ``TUNED_SOURCE``: the SuperNode's waits ``contract.transport.tune`` shortens; where they differ, Flower runs
  stock. ``COUNT_SOURCE``: the serialization ``contract.transport.message_bytes`` mirrors; where it differs, a
  message is serialized whole to be counted. ``RUNTIME_SOURCE``: ``flwr-clientapp``, which ``fl_client.tasks``
  serves tasks as (and sets a message's id as, ``set_message_id``), and the Runtime API client's interceptor chain
  ``fl_client.runtime_owner`` checks connections through; ``LAUNCH_SOURCE``: how SuperExec starts a run's
  ServerApp (by name, from PATH), where ``edgefl.launcher`` puts a warm one's shim, else Flower starts its own.
  ``SUBMIT_SOURCE``: ``flwr run``, which ``edgefl.launcher.submit`` calls in its own process (``flwr_run``), else
  starts as a command.
  ``CHANNEL_SOURCE``: the SuperNode's Runtime API router, whose dispatch ``fl_client.channel`` makes in the
  SuperNode's process; where it differs, the SuperNode serves no channel and its agent uses the HTTP API.
  ``PULL_SOURCE``: how the ServerApp's grid pulls replies, which ``contract.transport.pull_replies`` does with
  different nodes' replies pulled side by side; else the grid's own ``pull_messages``.
  ``GRID_SOURCE``: Flower's own FedAvg loop and the grids' ``send_and_receive``, through which
  ``fl_server.baseline`` meters it (``meter_grid``). ``RUNTIME_SOURCE`` and ``GRID_SOURCE`` have no stock
  to fall back to: where their code differs, they refuse in one line (``EdgeflError``).

Names used as they are documented in Flower's code (a proto message, ``ErrorCode``, the robust rules of
``flwr.server.strategy.aggregate``) are checked only for being there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.errors import EdgeflError

if TYPE_CHECKING:
    from flwr.app import Message
    from flwr.serverapp import Grid

FLWR_CHECKED = ("1.41.0", "1.42.0")  # every digest below is of these versions' code


def _installed() -> str:
    try:
        return importlib.metadata.version("flwr")
    except importlib.metadata.PackageNotFoundError:  # e.g. flwr-nightly
        return "none"


INSTALLED = _installed()  # read once, at import: the version every check below compares

# module -> the names edgefl takes from it, by user ("NAME as ALIAS": taken as ALIAS)
INTERNAL_NAMES: dict[str, tuple[str, ...]] = {
    # fl_client.tasks, the Runtime API client: what flwr-clientapp uses
    "flwr.app.message": ("remove_content_from_message", "make_message"),  # make_message: contract.transport
    "flwr.common.constant": ("ErrorCode", "SubStatus"),  # ErrorCode: fl_server.engine too
    "flwr.common.serde": ("context_from_proto", "context_to_proto", "message_from_proto", "message_to_proto"),
    "flwr.proto.message_pb2": (
        "Message as MessageProto",
        "ConfirmMessageReceivedRequest",  # contract.transport.pull_replies
        # fl_client.channel: the calls it carries
        "ConfirmMessageReceivedResponse", "PullObjectRequest", "PullObjectResponse", "PushObjectRequest",
        "PushObjectResponse",
    ),
    "flwr.proto.node_pb2": ("Node",),
    "flwr.proto.runtime_pb2": (
        "AcquireTaskRequest", "PullAppMessagesRequest", "PullTaskInputRequest", "PushAppMessagesRequest",
        "PushTaskOutputRequest", "SendTaskHeartbeatRequest",
        "AcquireTaskResponse", "PullAppMessagesResponse", "PullTaskInputResponse", "PushAppMessagesResponse",
        "PushTaskOutputResponse", "SendTaskHeartbeatResponse",  # fl_client.channel
    ),
    "flwr.supercore.constant": ("TaskType", "SYSTEM_MESSAGE_TYPE"),  # the latter: contract.transport.pull_replies
    "flwr.supercore.heartbeat": ("HeartbeatSender",),
    "flwr.supercore.inflatable.inflatable_object": (
        "get_all_nested_objects", "get_object_tree", "no_object_id_recompute",
        "get_object_body", "iterate_object_tree",  # contract.transport
    ),
    "flwr.supercore.inflatable.inflatable_protobuf_utils": (
        "make_confirm_message_received_fn_protobuf", "make_pull_object_fn_protobuf", "make_push_object_fn_protobuf",
    ),
    "flwr.supercore.inflatable.inflatable_utils": (
        "pull_and_inflate_object_from_tree", "push_objects",
        "ObjectPullError", "inflate_object_from_contents",  # contract.transport.pull_replies
    ),
    "flwr.supercore.interceptors": (
        "RuntimeTokenHttpInterceptor", "RuntimeVersionHttpInterceptor", "SuperExecAuthHttpInterceptor",
    ),
    "flwr.supercore.retry": ("RetryInvoker", "constant"),
    "flwr.supercore.runtime": ("RuntimeHttpClient",),
    "flwr.supercore.task_identity": ("TaskIdentity",),
    # fl_client.runtime_owner: an interceptor of the Runtime API client
    "flwr.supercore.protobuf.client": ("ProtobufCall", "ProtobufRequestContext", "ProtobufClient"),
    # fl_client.supernode
    "flwr.supernode.cli.flower_supernode": ("flower_supernode",),
    # fl_client.channel: what Flower's Runtime API handlers refuse with
    "flwr.supercore.error": ("FlowerError",),
    # contract.transport.message_bytes
    "flwr.proto.recorddict_pb2": ("ConfigRecord as ProtoConfigRecord",),
    # contract.transport.pull_replies: the ServerApp's grid, as Flower's HttpGrid.pull_messages pulls replies
    "flwr.superlink.grid.http_grid": ("HttpGrid",),
    "flwr.supercore.date": ("now",),
    # fl_server.app: its last word on Flower's exit
    "flwr.supercore.exit": ("add_exit_handler",),
    "flwr.cli.constant": ("FLOWER_CONFIG_FILE",),  # edgefl.launcher: the file flwr's CLI reads its federations from
    # fl_server.robust: Flower's robust rules
    "flwr.server.strategy.aggregate": ("aggregate_krum", "aggregate_median", "aggregate_trimmed_avg"),
}  # fmt: skip
# the modules contract.transport.tune changes, taken whole, by the name edgefl gives them
INTERNAL_MODULES = {
    "supernode_loop": "flwr.supernode.start_client_internal",
    "inflatable_utils": "flwr.supercore.inflatable.inflatable_utils",
    # fl_client.channel: the handlers the SuperNode's Runtime API router calls
    "node_runtime_handlers": "flwr.supernode.servicer.runtime.runtime_handlers",
    "core_runtime_handlers": "flwr.supercore.servicer.runtime.runtime_handlers",
}
# every internal name: the name edgefl uses -> (module, the attribute it is; None: the module itself)
INTERNAL: dict[str, tuple[str, str | None]] = {
    **{
        name.split(" as ")[-1]: (module, name.split(" as ")[0])
        for module, names in INTERNAL_NAMES.items()
        for name in names
    },
    **{alias: (module, None) for alias, module in INTERNAL_MODULES.items()},
}

# the SuperNode's loop and the object transfers, whose waits contract.transport shortens
TUNED_SOURCE = {
    "flwr.supernode.start_client_internal.start_client_internal": "9e89a6eb68fbec68",
    "flwr.supernode.start_client_internal._push_messages": "00bb86faffdec114",
    "flwr.supernode.start_client_internal._pull_and_store_message": "eaf5d0e36dc34e4c",
    "flwr.supercore.inflatable.inflatable_utils.pull_objects": "31bb2de46b450e6a",
    "flwr.supercore.inflatable.inflatable_utils.push_objects": "5893dafc584a46c8",
    "flwr.supercore.inflatable.inflatable_utils.push_object_contents_from_iterable": "89d2efe1cf720c91",
    "flwr.supercore.inflatable.inflatable_utils.get_num_workers": "d738f7dba5bff74b",
    "flwr.supercore.protobuf.client.ProtobufClient.__init__": "ea57554c6ab40501",  # its pool's keep-alive
}

# the SuperNode's Runtime API router and how it finds a call's task, whose dispatch fl_client.channel makes in the
# SuperNode's process (each call to the handler the router gives it, with the task its token names, on the state the
# loop was given; the SuperNode's handlers); where it differs, the SuperNode serves no channel and its agent uses HTTP
CHANNEL_SOURCE = {
    "flwr.supercore.routers.runtime.router.acquire_task": "dd75481efa7c4a7c",
    "flwr.supercore.routers.runtime.router.send_task_heartbeat": "1fbc6b7c7adf54a8",
    "flwr.supercore.routers.runtime.router.pull_task_input": "98df14ede0e65f3c",
    "flwr.supercore.routers.runtime.router.push_task_output": "f5e0b85db1077c26",
    "flwr.supercore.routers.runtime.router.push_object": "cea29ed48616b5b5",
    "flwr.supercore.routers.runtime.router.pull_object": "fa0eb2697dd47c36",
    "flwr.supercore.routers.runtime.router.confirm_message_received": "29d84ee73caa8c5e",
    "flwr.supercore.routers.runtime.router.push_messages": "195c0dab8d020cdc",
    "flwr.supercore.routers.runtime.router.pull_messages": "ef2d4efa53226888",
    "flwr.supercore.dependencies.task.authenticate_task": "7b4c0c58ea91353a",
    "flwr.supercore.dependencies.runtime.get_runtime_state": "4f4a1ca5e8a53c4d",
    "flwr.supernode.main.create_app": "f7215c8a9ef9279f",  # the SuperNode's handlers are the router's
    "flwr.supernode.cli.flower_supernode.flower_supernode": "e263e10452076b00",  # one state factory, both ends
    "flwr.supernode.nodestate.nodestate_factory.NodeStateFactory.state": "b1cb8f79bedddcb0",  # one state
}

# how the ServerApp's grid pulls replies, which contract.transport.pull_replies does with different nodes' replies
# pulled side by side; where it differs, the grid's own pull_messages
PULL_SOURCE = {"flwr.superlink.grid.http_grid.HttpGrid.pull_messages": "67a5266a5a2ed515"}

# the serialization contract.transport.message_bytes mirrors
COUNT_SOURCE = {
    "flwr.app.message.configrecord.ConfigRecord.deflate": "b7b5d3320c0a2494",
    "flwr.app.message.recorddict.RecordDict.deflate": "299a4095c874b251",
    "flwr.app.message.message.Message.deflate": "8ad1a4a4651b4246",
    "flwr.app.message.message.make_message": "7b10c6528e36538b",
    "flwr.supercore.inflatable.inflatable_object.add_header_to_object_body": "750d1611d693ede5",
    "flwr.supercore.inflatable.inflatable_object.get_object_body": "221a88d535135f90",
}

# flwr-clientapp, which fl_client.tasks serves tasks as (its calls, in its order; a message's id set in its
# metadata's __dict__); the object transfers it passes edgefl's waits to; the interceptor chain of Flower's
# Runtime API client, through which fl_client.runtime_owner checks each new connection before it is used
RUNTIME_SOURCE = {
    "flwr.supernode.runtime.run_clientapp.run_clientapp": "6ce09559f3a2f5dc",
    "flwr.supernode.runtime.run_clientapp.pull_task_input": "5607a23e1673ee87",
    "flwr.supernode.runtime.run_clientapp.push_message": "07cb512c93e065a9",
    "flwr.supernode.runtime.run_clientapp.push_task_output": "9206407456e79e17",
    "flwr.supercore.heartbeat.make_task_heartbeat_fn_http": "a50247986fc79b04",
    "flwr.supercore.inflatable.inflatable_utils.pull_and_inflate_object_from_tree": "139811483a15e4a6",
    "flwr.supercore.inflatable.inflatable_utils.pull_objects": "31bb2de46b450e6a",
    "flwr.supercore.inflatable.inflatable_utils.push_objects": "5893dafc584a46c8",
    "flwr.app.metadata.Metadata.__init__": "addaf6f8fb5b8030",
    "flwr.app.metadata.Metadata.message_id": "9e0e1b5a50c5ff09",
    "flwr.supercore.protobuf.client.ProtobufRequestContext": "ac89e51d64bb230c",
    "flwr.supercore.protobuf.client.ProtobufClient._send": "8841dcbf6e34dda2",
    "flwr.supercore.protobuf.client._wrap_interceptor": "afb53ef1401bddfd",
}

# Flower's own FedAvg (its loop, inherited from Strategy) and the grids' send_and_receive it calls, which call
# the grid's push_messages and pull_messages: what fl_server.baseline meters
STRATEGY_LOOP = "flwr.serverapp.strategy.FedAvg.start"
GRID_SOURCE = {
    STRATEGY_LOOP: "ce8c9834e592a755",
    "flwr.superlink.grid.http_grid.HttpGrid.send_and_receive": "699c9f048f3cff74",
    "flwr.superlink.grid.inmemory_grid.InMemoryGrid.send_and_receive": "0229edfa5741b928",
}

# how a SuperLink's SuperExec starts a run's ServerApp: the command TASK_TYPE_TO_COMMAND names, found on PATH, by
# the subprocess executor (SuperLink's SuperExec is given no other), where edgefl.launcher puts the shim of its warm
# ServerApp (fl_server.warm); where it differs, no shim is put there and Flower starts its own
LAUNCH_SOURCE = {
    "flwr.superlink.cli.flower_superlink._get_superexec_command": "5d60007f01d10102",
    "flwr.supercore.superexec.executor.subprocess_executor.SubprocessExecutor.launch": "83abf3dbe02281fd",
}
WARM = "starts a run's ServerApp warm by"  # what edgefl does with LAUNCH_SOURCE's code

# flwr run, which edgefl.launcher.submit calls in its own process (a process of its own spends ~1 s of CPU importing
# Flower's CLI before it submits) and reads the run id from its words; where it differs, flwr run is started
SUBMIT_SOURCE = {
    "flwr.cli.run.run.run": "dae6fa11a23b1026",
    "flwr.cli.run.run._run_with_control_api": "95f57c912e34174b",
}
SUBMITS = "submits a run in its own process by"  # what edgefl does with SUBMIT_SOURCE's code
STARTED_RUN = re.compile(r"Successfully started run (\d+)")  # flwr run's words, run id first

RUNTIME_API = "serves tasks by"  # what edgefl does with RUNTIME_SOURCE's code, in its refusal
METERED = "meters Flower's FedAvg by"  # ... with GRID_SOURCE's


def __getattr__(name: str) -> Any:
    """An ``INTERNAL`` name, imported on first use."""
    if name not in INTERNAL:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = INTERNAL[name]
    try:
        found = importlib.import_module(module)
        if attribute is not None:
            found = getattr(found, attribute)
    except (ImportError, AttributeError) as exc:
        missing = f"{module}.{attribute}" if attribute else module
        raise EdgeflError(f"flwr {INSTALLED} has no {missing} ({exc}); {_checked()}") from None
    globals()[name] = found
    return found


def __dir__() -> list[str]:
    return sorted({*globals(), *INTERNAL})


def _checked() -> str:
    return f"edgefl was checked against flwr {' and '.join(FLWR_CHECKED)}"


def source_digest(function: Callable[..., Any] | type) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def resolve(qualified: str) -> Any:
    """A module's function or class, or a class's method or property's getter (``module.Class.method``), by its
    qualified name."""
    parts = qualified.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found.fget if isinstance(found, property) else found
    raise ImportError(f"no module in {qualified}")


def why_differs(expected: Mapping[str, str], what: str) -> str | None:
    """None when the installed flwr is one of ``FLWR_CHECKED`` and each function of ``expected`` hashes to its
    digest; otherwise why not (one line). ``what``: what edgefl does with that code ("tunes", "counts by")."""
    if INSTALLED not in FLWR_CHECKED:
        return f"flwr {INSTALLED} is installed; edgefl {what} flwr {' or '.join(FLWR_CHECKED)}'s code only"
    for qualified, digest in expected.items():
        try:
            found = source_digest(resolve(qualified))
        except (ImportError, AttributeError, OSError, TypeError):
            return f"{qualified} is missing"
        if found != digest:
            return f"{qualified} is not the code edgefl {what} (source digest {found}, expected {digest})"
    return None


def code_key(expected: Mapping[str, str]) -> str:
    """A key of the installed flwr code ``expected`` names, found without importing it: the version, and each named
    function's module file as it is on disk (path, size, modification time) — for remembering ``why_differs``'s
    answer where importing that code costs a process memory it never otherwise needs (an agent and the SuperNode's
    database layer)."""
    key = hashlib.sha256(INSTALLED.encode())
    for qualified, digest in sorted(expected.items()):
        parts = qualified.split(".")
        for end in range(len(parts) - 1, 0, -1):
            candidates = ("/".join(parts[:end]) + ".py", "/".join(parts[:end]) + "/__init__.py")
            found = [path for c in candidates if (path := _installed_file(c)) is not None]
            if found:
                stat = found[0].stat()
                key.update(f"{qualified}={digest}@{found[0]}/{stat.st_size}/{stat.st_mtime_ns};".encode())
                break
        else:
            key.update(f"{qualified}=missing;".encode())
    return key.hexdigest()[:24]


def _installed_file(relative: str) -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution("flwr").locate_file(relative)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def refuse_unless_checked(expected: Mapping[str, str], what: str) -> None:
    """Raise ``EdgeflError`` (one line naming the installed flwr and the checked ones) unless ``why_differs``
    finds nothing: for the uses of Flower's code that have no stock fallback."""
    reason = why_differs(expected, what)
    if reason is not None:
        raise EdgeflError(reason if INSTALLED not in FLWR_CHECKED else f"flwr {INSTALLED} is installed but {reason}")


@functools.cache
def refuse_unless_runtime_api() -> None:
    """``refuse_unless_checked`` for ``RUNTIME_SOURCE``, once per process when it passes."""
    refuse_unless_checked(RUNTIME_SOURCE, RUNTIME_API)


def serverapp_command() -> str | None:
    """The command SuperExec starts a run's ServerApp as, by name from PATH, when ``LAUNCH_SOURCE`` holds the
    installed flwr's code; else None (``why_differs`` says why)."""
    if why_differs(LAUNCH_SOURCE, WARM) is not None:
        return None
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType

    return TASK_TYPE_TO_COMMAND[TaskType.SERVER_APP]


def flwr_run(app: Path, connection: str, flwr_home: Path) -> str | None:
    """Flower's ``flwr run APP CONNECTION`` called in this process (``$FLWR_HOME`` set to ``flwr_home`` while it
    runs), its words kept from this process's output: the run id. None where ``SUBMIT_SOURCE`` does not hold the
    installed flwr's code (start ``flwr run`` instead); Flower's refusal is raised in its words, on one line
    (``EdgeflError``)."""
    if why_differs(SUBMIT_SOURCE, SUBMITS) is not None:
        return None
    import click
    from flwr.cli.run.run import run

    said = io.StringIO()
    home = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = str(flwr_home)
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            run(str(app), connection, None, None, None, False, "default")
    except click.ClickException as exc:
        raise EdgeflError(" ".join(exc.format_message().split())) from None
    except click.exceptions.Exit as exc:
        raise EdgeflError(f"exit code {exc.exit_code}: {' '.join(said.getvalue().split())[-300:]}") from None
    finally:
        if home is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = home
    found = STARTED_RUN.search(said.getvalue())
    if found is None:
        raise EdgeflError(f"it named no run: {' '.join(said.getvalue().split())[-300:]}")
    return found.group(1)


def set_message_id(message: Message, message_id: str) -> None:
    """Give ``message`` its id as Flower's own ``flwr-clientapp`` does (a message's metadata holds its id in
    ``_message_id``, read-only to the public API); ``RUNTIME_SOURCE`` checks the layout."""
    message.metadata.__dict__["_message_id"] = message_id


def meter_grid(
    grid: Grid,
    push: Callable[[Callable[..., Any]], Callable[..., Any]],
    pull: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Replace ``grid``'s ``push_messages`` and ``pull_messages`` on this instance with ``push(its own)`` and
    ``pull(its own)``: what Flower's own FedAvg then calls, unchanged, through the grid's ``send_and_receive``.
    Refused (``EdgeflError``) unless ``GRID_SOURCE`` holds that grid's code, and the installed flwr's."""
    kind = type(grid)
    loop = f"{kind.__module__}.{kind.__qualname__}.send_and_receive"
    if loop not in GRID_SOURCE:
        raise EdgeflError(f"edgefl {METERED} the grids of GRID_SOURCE only, not {kind.__qualname__}; {_checked()}")
    refuse_unless_checked({STRATEGY_LOOP: GRID_SOURCE[STRATEGY_LOOP], loop: GRID_SOURCE[loop]}, METERED)
    grid.push_messages = push(grid.push_messages)  # type: ignore[method-assign]
    grid.pull_messages = pull(grid.pull_messages)  # type: ignore[method-assign]
