"""Pass pipelines as text, the way mlir-opt takes them, for `toptpu-opt` and the compile.

- `module_pipeline(text)`: `builtin.module(a,b{opt=v})` read as the module passes `a,b{opt=v}`;
- `check_pipeline_spec(text, available)`: a pipeline refused in one line for its syntax, an
  unknown pass (with the plugins that failed to load named), an unknown option or a value of
  the wrong type;
- `parse_passes(text)`: the pass instances of a pipeline, named pipelines (`top-pipeline`)
  expanded into the passes they run;
- `CompilePipeline`: what `toptpu compile` runs on each net, as the request asks it
  (`--top-pipeline`, `--tpu-pipeline`, `--pass-after PASS=PIPELINE`, `--pass-before
  PASS=PIPELINE`); the stages are

  - top: `shape-infer,canonicalize,fold-constants,cse,fuse,canonicalize,fold-constants,
    cse` by default, on Top IR;
  - convert: `convert-top-to-tpu{...}`, Top to Tpu IR: the request's mode, group size and
    symmetry and the net's types (not text);
  - tpu: `canonicalize,fold-constants,cse,weight-reorder` by default, on Tpu IR;
  - machine: `layer-group{chip},lmem-verify{chip},address-assign`, Tpu IR to grouped and
    addressed IR: the request's chip (not text).

  `--top-pipeline` and `--tpu-pipeline` replace their stage's passes; `--pass-after
  fuse=expand-silu` inserts passes after every run of a pass of any stage (`--pass-before`
  before it; `convert-top-to-tpu`'s insertions go to the end of the top stage and the start
  of the tpu stage). The model file records each net's passes as run (`NetEntry.pipeline`).

Passes come from `toptpu.plugins.available_passes`: xDSL's, toptpu's and the installed
plugins'.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints

from xdsl.passes import ModulePass
from xdsl.utils.arg_spec import ArgSpec, _convert_arg_to_type, parse_pipeline
from xdsl.utils.exceptions import ArgSpecParseError

from toptpu.errors import ToptpuError
from toptpu.passes.registry import PASSES
from toptpu.passes.top_pipeline import simplify_passes, top_pipeline_passes
from toptpu.plugins import available_passes, load_plugins


class PipelineTextError(ToptpuError, ValueError):
    """A pipeline text that cannot be run: the message says what and where."""


# ----------------------------------------------------------------------------- text


def spec_parse_problem(error: ArgSpecParseError) -> str:
    """xDSL's located multi-line parse error of a pipeline, as one clause."""
    text = str(error)
    where = re.search(r"pass-pipeline:\d+:(\d+)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    what = lines[-1].removesuffix(" here") if lines else "malformed"
    what = what[:1].lower() + what[1:]
    return f"{what} at column {where.group(1)}" if where else what


def describe_type(hint: Any) -> str:
    text = str(hint)
    for word, say in (("tuple", "a comma-separated list"), ("bool", "true or false"),
                      ("float", "a number"), ("int", "an integer"), ("str", "a string")):
        if word in text:
            return say
    return text


def pass_options(cls: type[ModulePass]) -> list[tuple[str, str, Any]]:
    """A pass's options as -p spells them: (name, what it takes, default)."""
    hints = get_type_hints(cls)
    return [(f.name.replace("_", "-"), describe_type(hints[f.name]), f.default)
            for f in dataclasses.fields(cls) if f.init and f.name != "name"]


def _unknown_pass_hint(name: str, available: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(available), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    broken = [p.line() for p in load_plugins().problems]
    if broken:
        hint += "; " + "; ".join(broken)
    return hint


def check_pipeline_spec(spec: str, available: Mapping[str, Callable[[], type[ModulePass]]],
                        flag: str = "-p", error: type[Exception] = PipelineTextError,
                        help_hint: str = "toptpu-opt --help lists the passes",
                        shown: str | None = None) -> None:
    """Refuse a pipeline that xDSL would refuse (or crash on), in one line naming `flag`
    and the text (`shown`, default `spec`) and the problem: its syntax, an unknown pass, an
    unknown option or a value of the wrong type."""
    shown = spec if shown is None else shown
    shown_spec = f"'{shown}'" if shown.isprintable() else repr(shown)  # one line
    try:
        specs = list(parse_pipeline(spec))
    except ArgSpecParseError as e:
        raise error(f"{flag} {shown_spec}: {spec_parse_problem(e)}") from None
    for s in specs:
        if s.name not in available:
            raise error(f"{flag} {shown_spec}: unknown pass '{s.name}'"
                        f"{_unknown_pass_hint(s.name, available)}; {help_hint}")
        cls = available[s.name]()
        options = {f.name: f for f in dataclasses.fields(cls)
                   if f.init and f.name != "name"}
        hints = get_type_hints(cls)
        for key, values in s.normalize_parameter_names().parameters.items():
            shown = key.replace("_", "-")
            if key not in options:
                valid = ", ".join(o.replace("_", "-") for o in options) or "none"
                raise error(f"{flag} {shown_spec}: pass '{s.name}' has no option '{shown}' "
                            f"(its options: {valid})")
            if not values:
                raise error(f"{flag} {shown_spec}: option '{shown}' of pass '{s.name}' "
                            f"needs a value ({shown}=...: {describe_type(hints[key])})")
            try:
                _convert_arg_to_type(values, hints[key])
            except ValueError:
                given = ",".join(str(v) for v in values)
                raise error(f"{flag} {shown_spec}: option '{shown}' of pass '{s.name}' "
                            f"takes {describe_type(hints[key])}, not {given}") from None


def _top_level_parens(spec: str, error: type[Exception]) -> list[tuple[int, int]]:
    """(open, close) of each parenthesis pair outside braces and quotes (options such as
    `mlir{pipeline="func.func(cse)"}` keep theirs); raises `error` when they do not pair
    up."""
    pairs: list[tuple[int, int]] = []
    opened: list[int] = []
    braces, quote, escaped = 0, False, False
    for i, c in enumerate(spec):
        if quote:
            quote = c != '"' or escaped
            escaped = c == "\\" and not escaped
            continue
        if c == '"':
            quote = True
        elif c == "{":
            braces += 1
        elif c == "}":
            braces -= 1
        elif braces == 0 and c == "(":
            opened.append(i)
        elif braces == 0 and c == ")":
            if not opened:
                raise error(f"pass pipeline '{spec}': ')' at column {i + 1} closes nothing")
            pairs.append((opened.pop(), i))
    if opened:
        raise error(f"pass pipeline '{spec}': '(' at column {opened[-1] + 1} is not closed")
    return pairs


def module_pipeline(spec: str, error: type[Exception] = PipelineTextError,
                    tool: str = "toptpu-opt") -> str:
    """A pass pipeline in mlir-opt's textual form, `builtin.module(pass1,pass2{opt=v})`, as
    the list of passes run on the module (`pass1,pass2{opt=v}`); a plain list is returned
    as it is. Nesting under another op (`func.func(...)`) is refused: toptpu's passes are
    module passes."""
    text = spec.strip()
    while True:
        pairs = _top_level_parens(text, error)
        if not pairs:
            return text
        first_open = min(o for o, _ in pairs)
        anchor = text[:first_open].strip()
        whole = (first_open, len(text) - 1) in pairs
        if anchor == "builtin.module" and whole:
            text = text[first_open + 1:-1].strip()
            continue
        nested = text[:first_open].rsplit(",", 1)[-1].strip() or "?"
        raise error(
            f"pass pipeline '{spec}': '{nested}(...)' nests passes under '{nested}': "
            f"{tool} runs module passes only; give them as builtin.module(pass1,pass2) "
            "or pass1,pass2")


def flatten(passes: Sequence[ModulePass]) -> list[ModulePass]:
    """`passes` with every named pipeline (`top-pipeline`, ...) replaced by the passes it
    runs, recursively: what the compile runs, dumps and checks pass by pass."""
    out: list[ModulePass] = []
    for p in passes:
        inner = getattr(p, "inner_passes", None)
        out.extend(flatten(inner()) if callable(inner) else [p])
    return out


def parse_passes(text: str, flag: str = "pipeline", shown: str | None = None
                 ) -> list[ModulePass]:
    """The passes of a pipeline text (checked: `check_pipeline_spec`; errors name `flag`
    and `shown`, default the text), named pipelines expanded (`flatten`)."""
    text = module_pipeline(text, tool="the compile")
    available = available_passes()
    check_pipeline_spec(text, available, flag, help_hint="toptpu-opt --help lists them",
                        shown=shown)
    try:
        return flatten([available[s.name]().from_pass_spec(s) for s in parse_pipeline(text)])
    except (ValueError, TypeError) as e:  # a pass refusing its options when made
        raise PipelineTextError(f"{flag} '{shown or text}': {e}") from None


def spec_text(passes: Sequence[ModulePass]) -> str:
    """The pipeline text of `passes` (each with the options it was given)."""
    return ",".join(str(p.pipeline_pass_spec()) for p in passes)


# ----------------------------------------------------------------------------- the compile's

Stage = Literal["top", "convert", "tpu", "machine"]
STAGES: tuple[Stage, ...] = ("top", "convert", "tpu", "machine")

#: the passes of the machine stage (`machine-pipeline`), by name
MACHINE_PASS_NAMES = ("layer-group", "lmem-verify", "address-assign")
#: the conversion between the top and the tpu stage
CONVERT = "convert-top-to-tpu"


def default_top_passes() -> list[ModulePass]:
    """The top stage by default: `top-pipeline`'s passes."""
    return top_pipeline_passes()


def default_tpu_passes() -> list[ModulePass]:
    """The tpu stage by default: canonicalize, fold-constants, cse, weight-reorder."""
    weight_reorder = PASSES["weight-reorder"]()  # the registry: imported when used
    return [*simplify_passes(), weight_reorder()]


DEFAULT_TOP = spec_text(default_top_passes())
#: (as text, so that reading it imports no Tpu pass: `tests/test_opt_driver.py` checks it)
DEFAULT_TPU = "canonicalize,fold-constants,cse,weight-reorder"


@dataclass(frozen=True)
class Insertion:
    """Passes (`pipeline`, text) run after (or before) every run of the pass `anchor`."""

    anchor: str
    pipeline: str
    before: bool = False

    @property
    def flag(self) -> str:
        return "--pass-before" if self.before else "--pass-after"

    def text(self) -> str:
        return f"{self.anchor}={self.pipeline}"

    @classmethod
    def parse(cls, value: str, before: bool) -> Insertion:
        flag = "--pass-before" if before else "--pass-after"
        if not isinstance(value, str):
            raise PipelineTextError(f"{flag} takes PASS=PIPELINE text, not {value!r}")
        anchor, eq, pipeline = value.partition("=")
        if not eq or not anchor.strip() or not pipeline.strip():
            raise PipelineTextError(f"{flag} '{value}': give PASS=PIPELINE, e.g. {flag} "
                                    "fuse=expand-silu (the passes to run "
                                    f"{'before' if before else 'after'} every run of PASS)")
        return cls(anchor.strip(), pipeline.strip(), before)


@dataclass(frozen=True)
class CompilePipeline:
    """The passes a compile runs on each net (see the module doc): the top and tpu stages'
    texts (None: the default) and the insertions, each checked when made (`make`)."""

    top: str | None = None
    tpu: str | None = None
    insertions: tuple[Insertion, ...] = ()

    @property
    def is_default(self) -> bool:
        return self.top is None and self.tpu is None and not self.insertions

    @classmethod
    def make(cls, top: Any = None, tpu: Any = None, after: Any = None,
             before: Any = None) -> CompilePipeline:
        """From the options as asked (texts; insertions as `PASS=PIPELINE` strings, a list
        of them, or a mapping PASS -> PIPELINE), every text parsed and every pass checked
        (PipelineTextError naming the option)."""
        for flag, text in (("--top-pipeline", top), ("--tpu-pipeline", tpu)):
            if text is not None and not isinstance(text, str):
                raise PipelineTextError(f"{flag} is pipeline text, not {text!r}")
        insertions = (*_insertions(after, False), *_insertions(before, True))
        made = cls(None if top is None else module_pipeline(top, tool="the compile"),
                   None if tpu is None else module_pipeline(tpu, tool="the compile"),
                   insertions)
        made.check()
        return made

    def check(self) -> None:
        """Every text parses into passes that exist; every insertion's anchor is a pass the
        pipeline runs."""
        if self.is_default:
            return
        runs = {CONVERT, *MACHINE_PASS_NAMES}
        for stage in ("top", "tpu"):
            runs.update(p.name for p in self._stage_text(stage))
        for ins in self.insertions:
            parse_passes(ins.pipeline, ins.flag, ins.text())
            if ins.anchor not in runs:
                raise PipelineTextError(
                    f"{ins.flag} '{ins.text()}': the compile runs no pass '{ins.anchor}' "
                    f"(it runs {', '.join(sorted(runs))})")

    def _stage_text(self, stage: Literal["top", "tpu"]) -> list[ModulePass]:
        text = self.top if stage == "top" else self.tpu
        if text is None:
            return default_top_passes() if stage == "top" else default_tpu_passes()
        return parse_passes(text, f"--{stage}-pipeline")

    def _insert(self, passes: list[ModulePass]) -> list[ModulePass]:
        out: list[ModulePass] = []
        for p in passes:
            out += [q for ins in self.insertions if ins.before and ins.anchor == p.name
                    for q in parse_passes(ins.pipeline, ins.flag, ins.text())]
            out.append(p)
            out += [q for ins in self.insertions if not ins.before and ins.anchor == p.name
                    for q in parse_passes(ins.pipeline, ins.flag, ins.text())]
        return out

    def stages(self, convert: ModulePass, machine: Sequence[ModulePass]
               ) -> dict[Stage, list[ModulePass]]:
        """The passes of each stage for one net: `convert` its conversion, `machine` the
        chip's machine passes; the insertions in place."""
        top = self._insert(self._stage_text("top"))
        around = self._insert([convert])
        at = around.index(convert)
        return {"top": top + around[:at], "convert": [convert],
                "tpu": around[at + 1:] + self._insert(self._stage_text("tpu")),
                "machine": self._insert(list(machine))}

    def keywords(self) -> dict[str, Any]:
        """The options that ask for this pipeline (`CompilePipeline.make`'s keywords by
        `toptpu compile`'s Python names)."""
        return {"top_pipeline": self.top, "tpu_pipeline": self.tpu,
                "pass_after": [i.text() for i in self.insertions if not i.before] or None,
                "pass_before": [i.text() for i in self.insertions if i.before] or None}

    def describe(self) -> str:
        """One line: the options that differ from the default ('default' when none)."""
        parts = [f"{flag} '{text}'" for flag, text in (("--top-pipeline", self.top),
                                                      ("--tpu-pipeline", self.tpu))
                 if text is not None]
        parts += [f"{i.flag} '{i.text()}'" for i in self.insertions]
        return " ".join(parts) or "default"


def _insertions(value: Any, before: bool) -> list[Insertion]:
    if value is None:
        return []
    if isinstance(value, str):
        return [Insertion.parse(value, before)]
    if isinstance(value, Mapping):
        return [Insertion.parse(f"{k}={v}", before) for k, v in value.items()]
    if isinstance(value, Sequence):
        return [Insertion.parse(v, before) for v in value]
    flag = "--pass-before" if before else "--pass-after"
    raise PipelineTextError(f"{flag} takes PASS=PIPELINE text (or a list of them), not "
                            f"{value!r}")


def pass_of_spec(spec: str, available: Mapping[str, Callable[[], type[ModulePass]]] | None
                 = None) -> ModulePass:
    """The one pass a pipeline text of one pass names (a dump's passes.json entry)."""
    available = available or available_passes()
    check_pipeline_spec(spec, available, "pass", help_hint="toptpu-opt --help lists them")
    specs: list[ArgSpec] = list(parse_pipeline(spec))
    if len(specs) != 1:
        raise PipelineTextError(f"'{spec}' names {len(specs)} passes, not one")
    return available[specs[0].name]().from_pass_spec(specs[0])


__all__ = ["CONVERT", "DEFAULT_TOP", "DEFAULT_TPU", "MACHINE_PASS_NAMES", "STAGES",
           "CompilePipeline", "Insertion", "PipelineTextError", "Stage",
           "check_pipeline_spec", "flatten", "module_pipeline", "parse_passes", "pass_of_spec",
           "pass_options", "spec_text"]
