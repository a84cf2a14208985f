"""The experiments `ffkv analyze` runs: each module declares itself, here they are found and ordered.

An experiment is one module with an ``EXPERIMENT = Experiment(...)`` at its end: its name, title and paper
section, what it needs (other experiments, the held-out pass), whether it applies to a masked-LM encoder, its
options, its two steps (``compute(ctx, options) -> Result``: the tables, their descriptions and what it records;
``draw(result) -> figures``, pure: figures by name, no file written), the paper's findings its tables and figures
stand beside (by exact name), the fidelity rules and the reading sentences for its tables, and the per-key columns
it adds to the explorer's layer page. `ffkv.experiments.analyze` writes what they return, the same way for every
experiment. `analyze`, the report, the command's ``--only`` help, the explorer and the docs read
them from here (`experiments`); nothing else lists the experiments.

The built-in experiments are the modules of ``ffkv.experiments`` that declare one. More come from outside the
package by the user's explicit request only: ``ffkv analyze RUN --plugin FILE.py`` (`load_plugin`) or an
installed distribution's entry point in the group ``ffkv.experiments`` (`load_entry_points`, never read from a
run directory: a run never makes code run).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ffkv.errors import FfkvError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

    from ffkv.experiments.common import RunContext

#: The entry-point group installed packages declare experiments in (``[project.entry-points."ffkv.experiments"]``
#: ``NAME = "package.module"``, or ``"package.module:EXPERIMENT"``).
ENTRY_POINT_GROUP = "ffkv.experiments"


@dataclass(frozen=True)
class Finding:
    """What the paper found for one figure or table, shown beside it in the report and the explorer."""

    figure: str
    finding: str

    def as_dict(self) -> dict[str, str]:
        return {"figure": self.figure, "finding": self.finding}


@dataclass(frozen=True)
class Encoder:
    """Whether an experiment applies to a masked-LM encoder (BERT, RoBERTa; `ffkv.experiments.encoders`), for
    which of the paper's figures, and why (the ``encoder_applicability`` table's row)."""

    applies: bool
    figures: str
    why: str


@dataclass(frozen=True)
class KeyColumn:
    """A per-key column an experiment adds to the explorer's layer page: `column` of the experiment's per-key
    table `table` (metrics/TABLE.parquet, one row per (layer, key)), shown under `header` and sorted by the
    URL's ``sort=`` `sort` (default: the header)."""

    table: str
    column: str
    header: str
    sort: str = ""

    @property
    def name(self) -> str:
        """The column's name on the layer page's table: TABLE_COLUMN."""
        return f"{self.table}_{self.column}"


@dataclass
class Result:
    """What an experiment's ``compute(ctx, options)`` returns; `ffkv.experiments.analyze` writes it (the tables to
    RUN/metrics/NAME.parquet with their descriptions, the record into manifest['analyses'][experiment]) and hands it
    to the experiment's ``draw``.

    Attributes:
        n_layers: the model's layers (the figures' layer axis).
        tables: full table name (the experiment's name or NAME_*) -> the table, in the order they are written.
        meta: table name -> its description (how it was computed), written in the table's Parquet metadata.
        record: what the experiment records besides the names of its tables and figures (which `analyze` adds;
            a ``tables`` entry here replaces the written ones, for a step whose tables another command writes).
        inputs: tables it read and does not write again that its ``draw`` shows (name -> table).
    """

    n_layers: int = 0
    tables: dict[str, "pd.DataFrame"] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, "pd.DataFrame"] = field(default_factory=dict)

    def add(self, name: str, table: "pd.DataFrame", **meta: Any) -> "pd.DataFrame":
        """Add the table `name` with its description `meta`; returns the table."""
        self.tables[name] = table
        self.meta[name] = meta
        return table

    def table(self, name: str) -> "pd.DataFrame":
        """The table `name`, written or read (`inputs`)."""
        return self.tables[name] if name in self.tables else self.inputs[name]


#: ``draw(result)``'s answer: figure name (RUN/figures/NAME.{png,svg}) -> the matplotlib figure, not yet saved.
Figures = Mapping[str, "Figure"]


def key_columns() -> tuple[KeyColumn, ...]:
    """The per-key columns of every registered experiment, in the paper's order."""
    return tuple(c for e in experiments().values() for c in e.key_columns)


@dataclass(frozen=True)
class Experiment:
    """One experiment of `ffkv analyze`, as its module declares it.

    Attributes:
        name: what ``--only`` names, and the prefix of its tables and figures (metrics/NAME*.parquet).
        title: the report's section heading.
        section: where it stands in the paper (or "beyond the paper" with its reference).
        order: its place in the paper's order (the report's sections; `analyze`'s steps where `after` allows).
        compute: ``compute(ctx, options) -> Result``: its tables, their descriptions and what it records (`options`:
            an instance of `options`, or None). It writes nothing itself, but where a genuine need says so in its
            docstring (a file kept beside the tables, such as the explorer's lookups or fitted translators).
        draw: ``draw(result) -> {figure name: figure}``, pure (no context, no file): `analyze` saves each as
            RUN/figures/NAME.{png,svg}. None: it draws nothing.
        after: experiments that run first when both run in one call (e.g. pruning reads the census of this call).
        needs: experiments whose results this one reads: they run first, and naming this one alone with ``--only``
            is refused unless the run holds them (`ffkv.experiments.needs`).
        held_out: reads the held-out examples (`RunContext.held_out`).
        held_out_reader: its reduction of the held-out pass at the analysed positions
            (`ffkv.experiments.heldout.read_held_out`: ``reader(ctx)`` with ``quantities``, ``read(rows, state)``
            per batch and ``result(rows)``): one forward pass serves every experiment of the call that declares one.
            A tuple of readers: each reads the same pass (composition: the neurons' reader and the latents').
        own_pass: the forward passes it runs of its own, and why the shared held-out pass does not serve them
            (empty: it runs none, or only the shared ones).
        optional: runs only when named in ``--only`` (it fits parameters: minutes on a GPU).
        encoder: whether it applies to a masked-LM encoder (None: it does, with no row in the applicability table).
        latents: what it computes for a sparse dictionary's latents, beside the neurons (the tables it writes), or,
            starting "not", why it computes nothing for them: the ``latent_applicability`` table's row for a run
            indexed with ``--dictionary`` (empty: "not computed for latents yet").
        options: a dataclass of its own options (`analyze(options={name: {...}})`), or None.
        skip_reason: ``skip_reason(ctx) -> str | None``, why it cannot run on this run (None: it can).
        findings: table or figure name -> the paper's finding beside it (exact names only).
        fidelity_tables: the tables its fidelity rules read (those the run holds, in this order).
        fidelity: ``fidelity(name, table, projections) -> rows`` of metrics/fidelity.parquet for one of them
            (`projections`: table name -> the projection it was read under).
        reading: ``reading(name, table) -> str | None``, one sentence on this model's numbers for a table.
        reading_rows: tables meant to be read row by row -> rows the report shows.
        how: description fields of its tables that say how they were computed (shown in its report section).
        key_columns: per-key columns it adds to the explorer's layer page.
        module: the module that declared it.
    """

    name: str
    title: str
    section: str
    order: float
    compute: Callable[["RunContext", Any], Result]
    draw: Callable[[Result], Figures] | None = None
    after: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    held_out: bool = False
    held_out_reader: Callable[["RunContext"], Any] | tuple[Callable[["RunContext"], Any], ...] | None = None
    own_pass: str = ""
    optional: bool = False
    encoder: Encoder | None = None
    latents: str = ""
    options: type | None = None
    skip_reason: Callable[["RunContext"], str | None] | None = None
    findings: Mapping[str, Finding] = field(default_factory=dict)
    fidelity_tables: tuple[str, ...] = ()
    fidelity: Callable[[str, "pd.DataFrame", Mapping[str, str]], list[dict]] | None = None
    reading: Callable[[str, "pd.DataFrame"], str | None] | None = None
    reading_rows: Mapping[str, int] = field(default_factory=dict)
    how: tuple[str, ...] = ()
    key_columns: tuple[KeyColumn, ...] = ()
    module: str = ""

    def __post_init__(self):
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise FfkvError(f"experiment name {self.name!r} must be a lower-case identifier (it names files)")
        if not callable(self.compute) or (self.draw is not None and not callable(self.draw)):
            raise FfkvError(f"experiment {self.name}: compute(ctx, options) -> Result and draw(result) -> figures "
                            "must be functions")
        if self.options is not None and not is_dataclass(self.options):
            raise FfkvError(f"experiment {self.name}: options must be a dataclass, got {self.options!r}")
        for table in self.findings:
            if table != self.name and not table.startswith(self.name + "_"):
                raise FfkvError(f"experiment {self.name}: finding for {table!r}, a name it does not own "
                                f"(its tables and figures are {self.name} and {self.name}_*)")

    def applies(self, encoder: bool) -> bool:
        """Whether `analyze` runs it on this model (every one on a causal LM)."""
        return not encoder or self.encoder is None or self.encoder.applies

    def parse_options(self, given: Mapping[str, Any] | None) -> Any:
        """Its options dataclass from `analyze(options={name: given})`; an unknown option is refused."""
        if self.options is None:
            if given:
                raise FfkvError(f"experiment {self.name} takes no options, got {', '.join(map(str, given))}")
            return None
        known = {f.name for f in fields(self.options)}
        unknown = [k for k in (given or {}) if k not in known]
        if unknown:
            raise FfkvError(f"unknown option {unknown[0]!r} of experiment {self.name}; "
                            f"choose from {', '.join(sorted(known))}")
        return self.options(**{k: v for k, v in (given or {}).items() if v is not None})


_BUILTIN: dict[str, Experiment] | None = None
_ADDED: dict[str, Experiment] = {}
_INSTALLED: list[Experiment] | None = None
_PLUGIN_FILES: dict[Path, Experiment] = {}


def _declared(module) -> Experiment:
    experiment = getattr(module, "EXPERIMENT", None)
    if not isinstance(experiment, Experiment):
        raise FfkvError(f"{getattr(module, '__file__', module.__name__)} declares no EXPERIMENT = Experiment(...)")
    return experiment


def builtin() -> dict[str, Experiment]:
    """The experiments of ffkv itself: every module of ``ffkv.experiments`` with an ``EXPERIMENT``."""
    global _BUILTIN
    if _BUILTIN is None:
        import ffkv.experiments as package

        found: dict[str, Experiment] = {}
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            source = Path(package.__path__[0]) / f"{info.name}.py"
            if not source.is_file() or "\nEXPERIMENT = Experiment(" not in source.read_text(encoding="utf-8"):
                continue  # the shared core and the tools built on it: imported only where used
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            experiment = getattr(module, "EXPERIMENT", None)
            if isinstance(experiment, Experiment):
                found[experiment.name] = experiment
        _BUILTIN = found
    return _BUILTIN


def experiments() -> dict[str, Experiment]:
    """Every known experiment (ffkv's own, those of installed packages' entry points, those added by plugins),
    in the paper's order."""
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = []  # set first: an installed experiment that asks for the registry while loading sees ffkv's
        _INSTALLED = load_entry_points()
    every = {**builtin(), **_ADDED}
    return dict(sorted(every.items(), key=lambda item: (item[1].order, item[0])))


def get(name: str) -> Experiment:
    """The experiment `name`; an unknown name is refused with the known ones."""
    every = experiments()
    if name not in every:
        raise FfkvError(f"unknown experiment {name!r}; choose from {', '.join(every)}")
    return every[name]


def register(experiment: Experiment) -> Experiment:
    """Add an experiment from outside the package (a plugin). A name already taken is refused."""
    if not isinstance(experiment, Experiment):
        raise FfkvError(f"not an Experiment: {experiment!r}")
    taken = {**builtin(), **_ADDED}.get(experiment.name)
    if taken is not None and taken is not experiment:
        raise FfkvError(f"experiment {experiment.name!r} is already defined (by {taken.module or 'ffkv'}); "
                        "choose another name")
    _ADDED[experiment.name] = experiment
    return experiment


def unregister(name: str) -> None:
    """Forget a plugin's experiment (ffkv's own cannot be removed)."""
    gone = _ADDED.pop(name, None)
    for path in [p for p, e in _PLUGIN_FILES.items() if e is gone]:
        del _PLUGIN_FILES[path]


def load_plugin(path: str | Path) -> Experiment:
    """Import a one-file experiment, FILE.py, and register its ``EXPERIMENT``: this runs the file's code, which
    the user asked for by naming it (``ffkv analyze RUN --plugin FILE.py``)."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise FfkvError(f"--plugin {path}: not a Python file")
    if path.resolve() in _PLUGIN_FILES:  # named twice: imported once
        return _PLUGIN_FILES[path.resolve()]
    module_name = f"ffkv_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FfkvError(f"--plugin {path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except FfkvError:
        raise
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise FfkvError(f"--plugin {path}: {type(error).__name__}: {error}") from error
    experiment = _declared(module)
    if not experiment.module:
        object.__setattr__(experiment, "module", str(path))
    _PLUGIN_FILES[path.resolve()] = register(experiment)
    return experiment


def load_entry_points() -> list[Experiment]:
    """Register the experiments installed packages declare in the entry-point group ``ffkv.experiments``."""
    from importlib.metadata import entry_points

    added = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = point.load()
        except Exception as error:  # an installed package's failure, named: not a traceback from ffkv
            raise FfkvError(f"the installed experiment {point.name} ({point.value}, entry point group "
                            f"{ENTRY_POINT_GROUP}) failed to import: {type(error).__name__}: {error}") from error
        experiment = loaded if isinstance(loaded, Experiment) else _declared(loaded)
        if not experiment.module:
            object.__setattr__(experiment, "module", point.value)
        added.append(register(experiment))
    return added


def ordered(names: Iterable[str], every: Mapping[str, Experiment] | None = None) -> list[str]:
    """`names` in the order `analyze` runs them: the paper's order, except that an experiment runs after those it
    `needs` (added when missing) and those it runs `after` (when both are named). A cycle or an unknown
    experiment is refused with one line."""
    every = dict(every if every is not None else experiments())
    chosen = list(dict.fromkeys(names))
    for name in chosen:
        if name not in every:
            raise FfkvError(f"unknown experiment {name!r}; choose from {', '.join(every)}")
    wanted = set(chosen)
    pending = list(chosen)
    while pending:  # what the chosen ones need, transitively
        for need in every[pending.pop()].needs:
            if need not in every:
                raise FfkvError(f"experiment needs unknown experiment {need!r}; known: {', '.join(every)}")
            if need not in wanted:
                wanted.add(need)
                pending.append(need)
    out: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise FfkvError(f"experiments depend on each other in a cycle: {' -> '.join((*path, name))}")
        state[name] = "visiting"
        experiment = every[name]
        for unknown in (n for n in experiment.after if n not in every):
            raise FfkvError(f"experiment {name} runs after unknown experiment {unknown!r}")
        first = [n for n in experiment.needs] + [n for n in experiment.after if n in wanted]
        for before in sorted(first, key=lambda n: (every[n].order, n)):
            visit(before, (*path, name))
        state[name] = "done"
        out.append(name)

    for name in sorted(wanted, key=lambda n: (every[n].order, n)):
        visit(name, ())
    return out


def default_names() -> list[str]:
    """What `analyze` runs by default: every experiment but the optional ones, in their run order."""
    return ordered(name for name, e in experiments().items() if not e.optional)


def paper_finding(name: str) -> dict[str, str] | None:
    """{"figure": "Figure 4", "finding": "..."} for a table or figure name: the finding its experiment (the one whose
    name it is or starts with, `experiment_of`) declares for that exact name, or None (a new table never inherits
    another's finding by sharing a prefix)."""
    experiment = experiments().get(experiment_of(name))
    found = experiment.findings.get(name) if experiment is not None else None
    return found.as_dict() if found is not None else None


def paper_order(name: str) -> tuple[int, int, str]:
    """Sort key of a figure or table name in the paper's order: its figures by number (Figure 2 first), then
    its tables, then names the paper has no finding for."""
    found = paper_finding(name) or {}
    kind, _, number = found.get("figure", "").partition(" ")
    if number.isdigit():
        return (0 if kind == "Figure" else 1), int(number), name
    return 2, 0, name


def experiment_of(name: str, every: Sequence[str] | None = None) -> str:
    """The experiment a table or figure belongs to: the longest experiment name it is or starts with (NAME_),
    else itself."""
    for experiment in sorted(every if every is not None else experiments(), key=len, reverse=True):
        if name == experiment or name.startswith(experiment + "_"):
            return experiment
    return name


def fidelity_tables() -> tuple[str, ...]:
    """The tables the fidelity rules read, in the order they are read."""
    return tuple(dict.fromkeys(t for e in experiments().values() for t in e.fidelity_tables))


def reading(name: str, table: "pd.DataFrame | None") -> str | None:
    """One sentence on this model's numbers for a table (the `reading` of the experiment that owns `name`), or
    None: a sentence is never made up from an arbitrary column."""
    if table is None or table.empty or "layer" not in table:
        return None
    experiment = experiments().get(experiment_of(name))
    if experiment is None or experiment.reading is None:
        return None
    return experiment.reading(name, table)


def only_help() -> str:
    """The experiments ``--only`` names, for ``ffkv analyze --help``: each with its paper section."""
    every = experiments()
    default = ", ".join(f"{n} ({every[n].section})" for n in default_names())
    optional = ", ".join(f"{n} ({e.section})" for n, e in every.items() if e.optional)
    return (f"comma-separated experiments (default: all), each with where it stands (beyond the paper: "
            f"docs/definitions.md): {default}" + (f"; and, only when named, {optional}" if optional else ""))
