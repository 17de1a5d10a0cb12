"""Every process of a `trl vllm-serve` test run imports this (PYTHONPATH; the launcher's bootstrap runs it after the
plugin): the engine stand-in, and the start method a user's platform would choose.

``SERVE_RECORD_DIR``: below every fix's wrapper, ``vllm.LLM.__init__`` only keeps the keyword arguments that reach
the engine; when TRL's worker then tells the server it is ready, they and the plugin's states in that process go to
``engine-<data-parallel rank>.json`` and the worker ends (TRL's server then has no worker left, and ends too).
``SERVE_FOREIGN_WRAPPER``: the stand-in sits inside another library's wrapt wrapper, as an instrumentation of vLLM
would. ``SERVE_START_METHOD``: the multiprocessing start method (spawn and forkserver re-import the server module in
each worker, as on macOS or Python >= 3.14).

The plugin's logger is at INFO, as a user turns it on (a handler, the ``trl_vlm_fixes`` logger at INFO): a healthy
engine's line is INFO. The handler writes the message alone, as Python's last-resort handler writes a WARNING.
"""

import json
import logging
import os
import sys
import types

import wrapt

_reached = []


def _engine(self, *args, **kwargs):
    _reached.append(kwargs)


def _foreign(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def _install(module):
    engine = module.LLM
    stand_in = wrapt.FunctionWrapper(_engine, _foreign) if os.environ.get("SERVE_FOREIGN_WRAPPER") else _engine
    layer = vars(engine)["__init__"]
    if type(layer) is types.FunctionType:  # no plugin (or not yet): the constructor itself
        engine.__init__ = stand_in
        return
    while type(layer.__wrapped__) is not types.FunctionType:  # type(): wrapt's proxies pretend
        layer = layer.__wrapped__
    layer.__wrapped__ = stand_in


def _report_when_ready(wrapped, instance, args, kwargs):
    if args and args[0] == {"status": "ready"}:  # llm_worker, right after LLM(...) returned
        plugin = sys.modules.get("trl_vlm_fixes")
        patches = plugin.status()["patches"] if plugin else {}
        plain = (str, int, float, bool, type(None), dict)
        record = {
            "kwargs": {key: v if isinstance(v, plain) else repr(v) for key, v in (_reached or [{}])[-1].items()},
            "engines": len(_reached),
            "states": {name: patches[name]["state"] for name in ("cudagraph", "gdn_prefill") if name in patches},
            "routed": os.environ.get("TRL_VLM_FIXES_ROUTE_ENGINE_SAMPLER"),
            "main": getattr(sys.modules["__main__"].__spec__, "name", None),
        }
        path = os.path.join(os.environ["SERVE_RECORD_DIR"], f"engine-{os.environ.get('VLLM_DP_RANK', '0')}.json")
        with open(path, "w") as file:
            json.dump(record, file)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return wrapped(*args, **kwargs)


logging.basicConfig(format="%(message)s")
logging.getLogger("trl_vlm_fixes").setLevel(logging.INFO)

if os.environ.get("SERVE_START_METHOD"):
    import multiprocessing

    multiprocessing.set_start_method(os.environ["SERVE_START_METHOD"], force=True)
if os.environ.get("SERVE_RECORD_DIR"):
    wrapt.register_post_import_hook(_install, "vllm.entrypoints.llm")
    wrapt.wrap_function_wrapper("multiprocessing.connection", "Connection.send", _report_when_ready)
