"""Tools, one module at a time: the python tool's sandbox (real child processes), the
calculator, tools from a function's signature, and vLLM's parser reading calls back."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from rollout.tools import ToolRegistry, call_tool
from rollout.tools.calculator import CalculatorError, calculator
from rollout.tools.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_time_s=4, cpu_time_s=1, memory_bytes=256 << 20, output_chars=500)


def run(code: str):
    t0 = time.monotonic()
    result = run_python(code, LIMITS)
    return result, time.monotonic() - t0


def test_code_runs_and_prints():
    result, _ = run("import math\nprint(math.factorial(10))\nopen('here.txt', 'w').write('ok')\nprint(open('here.txt').read())")
    assert result.ok and result.stdout == "3628800\nok\n" and result.text() == "3628800\nok\n"
    assert result.isolation in ("namespace", "audit")


def test_an_infinite_loop_is_stopped_at_the_cpu_limit():
    result, seconds = run("while True:\n    pass")
    assert result.stopped == "CPU time" and "[stopped: CPU time limit]" in result.text()
    assert seconds < LIMITS.cpu_time_s + 1.5


def test_sleeping_past_the_wall_time_is_stopped():
    result, seconds = run("import time\ntime.sleep(60)")
    assert result.stopped == "wall time" and LIMITS.wall_time_s <= seconds < LIMITS.wall_time_s + 1.5


@pytest.mark.parametrize("code", ["x = bytearray(1 << 30)", "a = []\nwhile True:\n    a.append(' ' * 10**6)"])
def test_a_memory_bomb_gets_memory_error(code):
    result, seconds = run(code)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and seconds < 3


@pytest.mark.parametrize(
    "code, refused",
    [
        ("import os\nwhile True:\n    os.fork()", "os.fork"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
        ("import multiprocessing\nmultiprocessing.Process(target=print).start()", "os.fork"),
        ("import _posixsubprocess\n_posixsubprocess.fork_exec()", "_posixsubprocess.fork_exec"),
        ("import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess", "import _posixsubprocess"),
        ("import os\nos.system('true')", "os.system"),
        ("import ctypes\nctypes.CDLL(None).system(b'true')", "ctypes"),
    ],
)
def test_a_fork_bomb_and_every_way_to_start_a_process_are_refused(code, refused):
    result, seconds = run(code)
    assert result.exit_code == 1 and "starting processes is not allowed" in result.stderr or "ctypes" in result.stderr, result.stderr
    assert refused in result.stderr and seconds < 3


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import socket\nsocket.socket()",
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
    ],
)
def test_network_access_is_refused(code):
    result, seconds = run(code)
    assert result.exit_code == 1 and "network access is not allowed" in result.stderr and seconds < 3


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
        f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', {str(target)!r})",
        f"import os\nos.rename('main.py', {str(target)!r})",
        "import os\nos.remove('/etc/hostname')",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
    ):
        result, _ = run(code)
        assert result.exit_code == 1 and "PermissionError: sandbox:" in result.stderr, (code, result.stderr)
    assert not target.exists() and os.path.exists("/etc/hostname")


def test_output_is_truncated_and_a_print_loop_ends():
    result, seconds = run("print('x' * 100000)")
    assert result.stdout.endswith("[output truncated]") and len(result.stdout) < LIMITS.output_chars + 40
    result, seconds = run("while True:\n    print('spam' * 100)")
    assert result.exit_code != 0 and seconds < LIMITS.wall_time_s + 1.5


@pytest.mark.parametrize(
    "expression, value",
    [("2+3", "5"), ("(3 + 4) * sqrt(16) / 2", "14"), ("2^10", "1024"), ("7 // 2 + 7 % 2", "4"), ("factorial(5)", "120"), ("-(1.5)", "-1.5"), ("max(3, 4)", "4")],
)
def test_the_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "9**9**9", "10**5000", "factorial(10**6)", "1/0", "x + 1", "'a' * 10", "(1).__class__"])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression):
    with pytest.raises(CalculatorError):
        calculator(expression)


def test_a_tool_is_its_function_signature():
    registry = ToolRegistry({"shorten": "textwrap:shorten"})
    assert sorted(registry.tools) == ["calculator", "python", "shorten"]
    fn = registry.tools["calculator"].openai()["function"]
    assert fn["parameters"] == {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"], "additionalProperties": False}
    assert fn["strict"] is True and fn["description"].startswith("Evaluate an arithmetic expression")
    assert registry.tools["shorten"].parameters["required"] == ["text", "width"]
    with pytest.raises(ValueError, match="argument expression"):
        call_tool(calculator, {"expr": "1"})
    with pytest.raises(ValueError, match=r"tools.functions.t: time:time: no signature"):
        ToolRegistry({"t": "time:time"})
    from rollout.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        registry.offered(["calculator", "web_search"])
    assert e.value.field == "tools[1]"


def test_the_config_refuses_a_builtin_name_and_a_bad_path():
    from pydantic import ValidationError

    from rollout.config import ToolsConfig

    with pytest.raises(ValidationError, match="tools.functions.python: the name of a built-in tool"):
        ToolsConfig(functions={"python": "x:y"})
    with pytest.raises(ValidationError, match="is not 'module:function'"):
        ToolsConfig(functions={"f": "nocolon"})


def test_vllms_parser_forces_and_reads_calls_in_the_models_format(model_dir):
    from transformers import AutoTokenizer

    from rollout.tools.calling import ToolCalling

    registry = ToolRegistry({})
    tools = registry.offered(["calculator", "python"])
    calling = ToolCalling(AutoTokenizer.from_pretrained(model_dir), "hermes")
    # auto: free text, but a call, once the model opens one, follows the tool's schema.
    assert json.loads(calling.plan(tools, "auto").structured_outputs.structural_tag)["format"]["triggers"] == ["<tool_call>"]
    assert calling.plan(tools, "none").structured_outputs is None
    for choice in ("required", {"name": "calculator"}):
        tag = json.loads(calling.plan(tools, choice).structured_outputs.structural_tag)
        assert "<tool_call>" in json.dumps(tag), "the call is forced in hermes's own format"
    plan = calling.plan(tools, "auto")
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    (call,) = calling.parse(plan, text, [])
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "6*7"}) and call.id
    assert calling.parse(plan, "no call here", []) == []
