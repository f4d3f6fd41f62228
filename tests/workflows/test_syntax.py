"""Load-time validation: bad definitions fail with the step name and line number."""

from __future__ import annotations

import pytest

from cloudworkflows import WorkflowSyntaxError, load_workflow


def syntax_error(src: str) -> WorkflowSyntaxError:
    with pytest.raises(WorkflowSyntaxError) as info:
        load_workflow(src)
    return info.value


def test_unknown_step_key_names_step_and_line() -> None:
    err = syntax_error(
        """\
main:
  steps:
    - first:
        assign:
          - x: 1
    - second:
        call: sys.log
        argz:
          text: hi
"""
    )
    assert err.step == "second"
    assert err.line == 8
    assert "argz" in str(err) and "second" in str(err) and "line 8" in str(err)


def test_unknown_step_shape() -> None:
    err = syntax_error("- a:\n    assign:\n      - x: 1\n- weird:\n    frobnicate: true\n")
    assert (err.step, err.line) == ("weird", 4)


def test_unknown_function_in_call_step() -> None:
    err = syntax_error("- a:\n    assign:\n      - x: 1\n- b:\n    call: text.nonexistent\n")
    assert (err.step, err.line) == ("b", 4)
    assert "text.nonexistent" in str(err)


def test_unknown_function_in_expression() -> None:
    err = syntax_error("- a:\n    return: ${foo.bar(1)}\n")
    assert (err.step, err.line) == ("a", 1)
    assert "foo.bar" in str(err)


def test_blocking_function_not_allowed_in_expression() -> None:
    err = syntax_error('- a:\n    return: ${http.get("http://127.0.0.1:1")}\n')
    assert err.step == "a" and "call step" in str(err)


def test_bad_expression_syntax() -> None:
    err = syntax_error("- a:\n    assign:\n      - x: 1\n      - y: ${x +}\n")
    assert (err.step, err.line) == ("a", 4)


def test_unknown_next_target() -> None:
    err = syntax_error("- a:\n    next: nowhere\n")
    assert err.step == "a" and "nowhere" in str(err)


def test_break_outside_loop() -> None:
    err = syntax_error("- a:\n    next: break\n")
    assert "break" in str(err)


def test_combined_step_kinds_rejected() -> None:
    err = syntax_error("- a:\n    assign:\n      - x: 1\n    return: 2\n")
    assert err.step == "a"


def test_duplicate_step_names() -> None:
    err = syntax_error("- a:\n    assign:\n      - x: 1\n- a:\n    return: 1\n")
    assert (err.step, err.line) == ("a", 4)


def test_subworkflow_argument_checks() -> None:
    src = """\
main:
  steps:
    - c:
        call: sub
        args:
          wrong: 1
sub:
  params: [x]
  steps:
    - r:
        return: ${x}
"""
    err = syntax_error(src)
    assert err.step == "c" and "wrong" in str(err)
    err = syntax_error(src.replace("          wrong: 1\n", "").replace("        args:\n", ""))
    assert "missing" in str(err)


def test_parallel_requires_shared_for_parent_variables() -> None:
    err = syntax_error(
        """\
- init:
    assign:
      - total: 0
- p:
    parallel:
      branches:
        - b1:
            steps:
              - w:
                  assign:
                    - total: 1
"""
    )
    assert err.step == "b1" and "total" in str(err)


def test_shared_variable_must_be_declared_before() -> None:
    err = syntax_error(
        "- p:\n    parallel:\n      shared: [nope]\n      branches:\n"
        "        - b:\n            steps:\n              - s:\n                  assign:\n"
        "                    - nope: 1\n"
    )
    assert err.step == "p" and "nope" in str(err)


def test_unsupported_exception_policy() -> None:
    err = syntax_error(
        "- p:\n    parallel:\n      exception_policy: failFast\n      branches:\n"
        "        - b:\n            steps:\n              - s:\n                  return: 1\n"
    )
    assert "exception_policy" in str(err)


def test_retry_needs_predicate_and_max_retries() -> None:
    err = syntax_error("- t:\n    try:\n      call: sys.now\n    retry:\n      max_retries: 2\n")
    assert err.step == "t" and "predicate" in str(err)


def test_main_missing_and_invalid_yaml() -> None:
    assert "main" in str(syntax_error("other:\n  steps:\n    - a:\n        return: 1\n"))
    err = syntax_error("- a:\n    return: [1,\n")
    assert "YAML" in str(err)


def test_for_requires_in_or_range() -> None:
    err = syntax_error("- l:\n    for:\n      value: v\n      steps:\n        - s:\n            return: 1\n")
    assert err.step == "l"


def test_json_definition_and_implicit_main() -> None:
    wf = load_workflow('[{"a": {"assign": [{"x": 2}]}}, {"b": {"return": "${x * 21}"}}]')
    assert wf.run() == 42


def test_lines_are_tracked_in_nested_steps() -> None:
    src = """\
main:
  steps:
    - outer:
        steps:
          - inner:
              try:
                steps:
                  - deep:
                      call: no.such.thing
              except:
                steps:
                  - h:
                      return: 1
"""
    err = syntax_error(src)
    assert (err.step, err.line) == ("deep", 8)


# --- limits Google enforces at deployment (cloudworkflows.syntax: the conditions page's 50, and the
# bounds of Google's JSON schema, GoogleCloudPlatform/workflows-samples jsonschema/workflows.json) ---


def assign_step(n: int) -> str:
    return (
        "- a:\n    assign:\n"
        + "".join(f"      - v{i}: {i}\n" for i in range(n))
        + "- done:\n    return: ${v0}\n"
    )


def switch_step(n: int) -> str:
    conditions = "".join(f"      - condition: ${{x == {i}}}\n        next: done\n" for i in range(n))
    return (
        "- init:\n    assign:\n      - x: 1\n- s:\n    switch:\n" + conditions + "- done:\n    return: ${x}\n"
    )


def parallel_step(n: int) -> str:
    branches = "".join(
        f"        - b{i}:\n            steps:\n              - s{i}:\n                  return: {i}\n"
        for i in range(n)
    )
    return "- p:\n    parallel:\n      branches:\n" + branches


def subworkflow_with(n: int) -> str:
    params = ", ".join(f"p{i}" for i in range(n))
    head = "main:\n  steps:\n    - done:\n        return: 1\n"
    return head + f"sub:\n  params: [{params}]\n  steps:\n    - r:\n        return: ${{p0}}\n"


def test_an_assign_step_holds_at_most_50_assignments() -> None:
    assert load_workflow(assign_step(50)).run() == 0
    err = syntax_error(assign_step(51))
    assert err.step == "a" and "at most 50 assignments, this one 51" in str(err)


def test_a_switch_step_holds_at_most_50_conditions() -> None:
    assert load_workflow(switch_step(50)).run() == 1
    err = syntax_error(switch_step(51))
    assert err.step == "s" and "at most 50 conditions, this one 51" in str(err)


def test_a_parallel_step_has_at_most_10_branches() -> None:
    load_workflow(parallel_step(10))
    err = syntax_error(parallel_step(11))
    assert err.step == "p" and "at most 10 branches, this one 11" in str(err)


def test_a_subworkflow_takes_at_most_10_params() -> None:
    load_workflow(subworkflow_with(10))
    err = syntax_error(subworkflow_with(11))
    assert err.step == "sub" and "at most 10 params, this one 11" in str(err)


def test_a_result_targets_index_must_name_a_variable() -> None:
    src = (
        "- init:\n    assign:\n      - m: {}\n"
        "- c:\n    call: sys.now\n    result: m[KEY]\n"
        "- done:\n    return: ${m}\n"
    )
    assert list(load_workflow(src.replace("KEY", '"now"')).run()) == ["now"]
    err = syntax_error(src.replace("KEY", "missingKey"))
    assert err.step == "c" and "symbol 'missingKey' is neither a variable nor a sub-workflow name" in str(err)


def test_except_variables_are_not_the_parallel_steps_parent_scope() -> None:
    """A branch may create a variable of the name an except block used (it is not the parent's), and
    ``shared`` cannot name a variable that only an except block creates."""
    attempt = (
        "- attempt:\n    try:\n      raise: boom\n    except:\n      as: e\n      steps:\n"
        "        - note:\n            assign:\n              - why: ${e}\n"
    )
    branch = (
        "        - b{i}:\n            steps:\n"
        "              - s{i}:\n                  assign:\n                    - why: {i}\n"
    )
    parallel = "- p:\n    parallel:\n{shared}      branches:\n" + branch.format(i=1) + branch.format(i=2)
    load_workflow(attempt + parallel.format(shared=""))
    err = syntax_error(attempt + parallel.format(shared="      shared: [why]\n"))
    assert err.step == "p" and "shared variable 'why' must be declared before the parallel step" in str(err)


def nested_parallel(depth: int) -> str:
    """``depth`` parallel steps, each inside the first branch of the one before."""
    body = "return: 1"
    for level in range(depth, 0, -1):
        indented = body.replace("\n", "\n" + " " * 14)
        body = (
            "parallel:\n  branches:\n"
            f"    - a{level}:\n        steps:\n          - in{level}:\n              {indented}\n"
            f"    - b{level}:\n        steps:\n          - s{level}:\n              return: 2"
        )
    return "- top:\n    " + body.replace("\n", "\n    ") + "\n"


def test_parallel_steps_nest_at_most_2_deep() -> None:
    load_workflow(nested_parallel(2))
    err = syntax_error(nested_parallel(3))
    assert "parallel steps nest at most 2 deep, this one 3" in str(err)


def test_the_source_is_at_most_128_kb() -> None:
    padding = "# " + "x" * 1000 + "\n"
    fits = "- done:\n    return: 1\n"
    load_workflow(padding * 120 + fits)
    assert "more than 131072" in str(syntax_error(padding * 131 + fits))
