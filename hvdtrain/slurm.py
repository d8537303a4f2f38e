"""Slurm job scripts: render the ``train.sbatch`` template from a config and job options, check it,
submit it.

The script runs one ``horovodrun`` over the allocation (hosts from ``SLURM_JOB_NODELIST``, slots
from ``--ntasks-per-node``), or one ``srun --mpi=pmix`` whose tasks initialise Horovod from MPI,
asks for ``USR1`` ahead of preemption or the time limit, forwards it to the ranks (which checkpoint
and exit 75) and then requeues itself; the requeued job resumes with
``checkpoint.resume=auto``. Framework-free: nothing here imports torch or tensorflow.

The templates and the elastic job's host discovery script live in the top-level ``slurm/``
directory, which a wheel ships as the package data ``hvdtrain/_slurm/`` (see setup.py), read through
:mod:`importlib.resources`, so an installed hvdtrain renders its jobs without a checkout.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from hvdtrain.config import Config, load_config
from hvdtrain.errors import HvdtrainError, os_failure
from hvdtrain.rundir import RunDir, read_records

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable


def _templates() -> Traversable:
    """The directory of the templates: the wheel's copy inside the package when there is one, else
    the checkout's ``slurm/`` (an editable install or PYTHONPATH runs hvdtrain from a checkout,
    which has no ``hvdtrain/_slurm/``)."""
    shipped = resources.files("hvdtrain") / "_slurm"
    if shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parent.parent / "slurm"


TEMPLATES = _templates()
"""The sbatch templates (Jinja2) and the host discovery script: ``slurm/``, shipped in the wheel."""
DISCOVERY = "discover_hosts_slurm.sh"
"""The elastic job's host discovery script, a file of :data:`TEMPLATES`."""
CONTROLLERS = ("gloo", "mpi")
LAUNCHERS = ("horovodrun", "srun")
BASE_STOP_S = 30
"""Seconds a stop needs besides the steps up to the next log interval: writing the checkpoint and
the launcher shutting the ranks down (a horovodrun start or stop takes seconds)."""
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_MEMORY = re.compile(r"^[1-9][0-9]*[KMGT]?$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_NP = re.compile(r"horovodrun\"? -np (\d+)|srun --mpi=\S+ --ntasks=(\d+)")


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What ``sbatch`` is asked for, besides the training config."""

    nodes: int = 1
    """Nodes in the allocation."""
    tasks_per_node: int = 1
    """Horovod ranks (Slurm tasks) per node."""
    time: str = "01:00:00"
    """Time limit, in a format Slurm accepts (``MM``, ``HH:MM:SS``, ``D-HH:MM``)."""
    partition: str = ""
    """Partition (empty: the cluster's default)."""
    account: str = ""
    """Account to charge (empty: the user's default)."""
    mem_per_cpu: str = ""
    """Memory a CPU (a rank) may use, Slurm's ``--mem-per-cpu`` (``1500M``, ``4G``); empty: the
    cluster's default. Under ``task/cgroup`` a job past it is killed and ends ``OUT_OF_MEMORY``."""
    mem: str = ""
    """Memory a node's tasks may use together, Slurm's ``--mem`` (``4G``); empty: the cluster's
    default. Slurm takes either this or ``mem_per_cpu``. With :attr:`overcommit`, where a node
    gives fewer CPUs than ranks, it is the way to give the ranks their memory."""
    overcommit: bool = False
    """Ask for the ranks as ``--ntasks`` with ``--overcommit`` instead of ``--ntasks-per-node``:
    Slurm then allocates one CPU a node however many ranks run there (a node with fewer cores
    than ``tasks_per_node``, such as a test cluster's). horovodrun still places
    ``tasks_per_node`` ranks on each node; ``--launcher srun`` is refused."""
    signal_lead: int = 120
    """Seconds before the end at which Slurm sends USR1 so that the run can checkpoint."""
    controller: str = "gloo"
    """Horovod's controller under ``horovodrun``: ``gloo`` or ``mpi`` (``srun`` always uses MPI)."""
    launcher: str = "horovodrun"
    """``horovodrun`` (ssh-free on one node; Gloo or MPI) or ``srun`` (Slurm starts ranks; MPI)."""
    gpus_per_node: int = 0
    """GPUs per node (``--gres=gpu:N``); with GPUs, one rank per GPU, pinned by local rank."""
    elastic: bool = False
    """Render ``elastic.sbatch``: elastic Horovod (Gloo) with Slurm-aware host discovery."""
    min_nodes: int = 1
    """Elastic only: the job goes on while at least this many nodes are usable."""
    server_nodes: int = 0
    """Parameter servers on nodes of their own (``comm.topology=ps`` with dedicated servers): the
    job takes ``nodes`` worker nodes plus this many, and the ``ps.servers`` servers (the last
    ranks) are spread evenly over the extra ones. 0: servers, if any, share the worker nodes."""
    network_interface: str = ""
    """The interface the ranks talk over (empty: Horovod's and Open MPI's choice): horovodrun's
    ``--network-interfaces`` (Gloo, and Open MPI's ``btl_tcp_if_include`` under ``--mpi``), or under
    ``srun`` Open MPI's ``btl_tcp_if_include`` and NCCL's ``NCCL_SOCKET_IFNAME``."""

    def validate(self) -> None:
        """Raises :class:`HvdtrainError` for an option that sbatch or horovodrun cannot take."""
        if self.nodes < 1 or self.tasks_per_node < 1:
            raise HvdtrainError(f"--nodes={self.nodes} --tasks-per-node={self.tasks_per_node}: "
                                "both must be >= 1")
        if not _TIME.match(self.time):
            raise HvdtrainError(f"--time={self.time!r}: expected MM, HH:MM:SS or D-HH:MM:SS")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value and not _NAME.match(value):
                raise HvdtrainError(f"{flag}={value!r}: letters, digits, '_', '.' and '-' only")
        if self.mem_per_cpu and not _MEMORY.match(self.mem_per_cpu):
            raise HvdtrainError(f"--mem-per-cpu={self.mem_per_cpu!r}: expected a size such as "
                                "1500M or 4G (K, M, G or T; M when no unit)")
        if self.mem and not _MEMORY.match(self.mem):
            raise HvdtrainError(f"--mem={self.mem!r}: expected a size such as 4G or 1500M "
                                "(K, M, G or T; M when no unit)")
        if self.mem and self.mem_per_cpu:
            raise HvdtrainError("--mem and --mem-per-cpu: Slurm takes one of them, not both")
        if self.overcommit and self.launcher == "srun":
            raise HvdtrainError("--overcommit: renders for --launcher horovodrun only (srun "
                                "would start each task on a CPU of its own)")
        if self.signal_lead < 0:
            raise HvdtrainError(f"--signal-lead={self.signal_lead}: must be >= 0 seconds")
        if self.controller not in CONTROLLERS:
            raise HvdtrainError(f"--controller={self.controller!r}: "
                                f"expected one of {', '.join(CONTROLLERS)}")
        if self.launcher not in LAUNCHERS:
            raise HvdtrainError(f"--launcher={self.launcher!r}: "
                                f"expected one of {', '.join(LAUNCHERS)}")
        if self.gpus_per_node < 0:
            raise HvdtrainError(f"--gpus-per-node={self.gpus_per_node}: must be >= 0")
        if self.elastic and (self.launcher != "horovodrun" or self.controller != "gloo"):
            raise HvdtrainError("--elastic: elastic Horovod runs under horovodrun with Gloo only")
        if not 1 <= self.min_nodes <= self.nodes:
            raise HvdtrainError(f"--min-nodes={self.min_nodes}: "
                                f"must be between 1 and --nodes={self.nodes}")
        if self.server_nodes < 0:
            raise HvdtrainError(f"--server-nodes={self.server_nodes}: must be >= 0")
        if self.server_nodes and self.elastic:
            raise HvdtrainError("--server-nodes: parameter servers do not run in elastic mode")
        if self.network_interface and not _NAME.match(self.network_interface):
            raise HvdtrainError(f"--network-interface={self.network_interface!r}: "
                                "not an interface name")


def _sbatch_path(path: Path, what: str, suffix: str = "") -> str:
    """A path for an ``#SBATCH`` line, which sbatch parses itself (double quotes, no shell)."""
    text = str(path)
    if any(ch in text for ch in '"\n%\\'):
        raise HvdtrainError(f"{what} {text!r}: a path for #SBATCH lines may not hold "
                            "'\"', '%', '\\' or newlines")
    text += suffix
    return f'"{text}"' if re.search(r"\s", text) else text


def _job_overrides(overrides: Sequence[str], options: JobOptions) -> list[str]:
    elastic = ["elastic.enabled=true"] if options.elastic else []
    return [*overrides, "checkpoint.resume=auto", *elastic]


def discovery_script() -> Path:
    """The host discovery script's path in the installed package, which the job runs on its nodes
    (so the package must sit on a file system that they share, as the virtual environment does)."""
    path = TEMPLATES / DISCOVERY
    if not isinstance(path, Path):  # a zipped package: horovodrun needs a file it can execute
        raise HvdtrainError(f"--elastic: {DISCOVERY} is not a file on disk ({path}); "
                            "install hvdtrain unzipped")
    return path


def _template_source(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def run_dir_of(cfg: Config) -> RunDir:
    """The run directory at an absolute path (a relative one is from the current directory)."""
    return RunDir((Path.cwd() / cfg.run_dir).resolve())


def render(config_path: str | Path, overrides: Sequence[str] = (),
       options: JobOptions = JobOptions()) -> str:
    """The text of ``train.sbatch`` (``elastic.sbatch`` for an elastic job) for this config,
    overrides and job options."""
    import jinja2

    options.validate()
    # As the job will run it (--elastic adds elastic.enabled=true): a bad config fails here, not
    # in the queue.
    cfg = load_config(config_path, _job_overrides(overrides, options))
    servers_per_node = _servers_per_node(cfg, options)
    run_dir = run_dir_of(cfg)
    env = jinja2.Environment(loader=jinja2.FunctionLoader(_template_source), autoescape=False,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = "elastic.sbatch" if options.elastic else "train.sbatch"
    return env.get_template(template).render(
        job_name=cfg.name if _NAME.match(cfg.name) else "hvdtrain",
        nodes=options.nodes, tasks_per_node=options.tasks_per_node, ntasks=total_ranks(cfg, options),
        server_nodes=options.server_nodes, servers_per_node=servers_per_node, time=options.time,
        partition=options.partition, account=options.account, mem_per_cpu=options.mem_per_cpu,
        mem=options.mem, overcommit=options.overcommit, signal_lead=options.signal_lead,
        controller=options.controller, launcher=options.launcher,
        gpus_per_node=options.gpus_per_node, min_np=options.min_nodes * options.tasks_per_node,
        network_interface=options.network_interface,
        discovery_q=shlex.quote(str(discovery_script())) if options.elastic else "",
        output=_sbatch_path(run_dir.root, "log.dir", "/" + run_dir.slurm_output().name),
        workdir=_sbatch_path(Path.cwd(), "working directory"),
        bin_dir_q=shlex.quote(str(Path(sys.executable).parent)),
        run_dir_q=shlex.quote(str(run_dir.root)),
        stop_flag_q=shlex.quote(str(run_dir.stop_flag)),
        exclude_hosts_q=shlex.quote(str(run_dir.exclude_hosts)),
        config_q=shlex.quote(str(config_path)),
        overrides_q=[shlex.quote(item) for item in _job_overrides(overrides, options)])


def _servers_per_node(cfg: Config, options: JobOptions) -> int:
    """How many parameter servers each of ``--server-nodes`` runs (0 without server nodes); raises
    for a config those nodes cannot serve."""
    if not options.server_nodes:
        return 0
    if cfg.comm.topology != "ps" or cfg.ps.placement != "dedicated":
        raise HvdtrainError(f"--server-nodes={options.server_nodes}: needs comm.topology=ps with "
                            f"ps.placement=dedicated (the config has comm.topology="
                            f"{cfg.comm.topology})")
    if options.launcher == "horovodrun" and options.controller != "mpi":
        raise HvdtrainError("--server-nodes: dedicated parameter servers talk over MPI: use "
                            "--controller mpi or --launcher srun")
    per_node, rest = divmod(cfg.ps.servers, options.server_nodes)
    if rest or not 1 <= per_node <= options.tasks_per_node:
        raise HvdtrainError(f"--server-nodes={options.server_nodes}: ps.servers={cfg.ps.servers} "
                            "must be a multiple of it, at most --tasks-per-node="
                            f"{options.tasks_per_node} servers a node")
    return per_node


def total_ranks(cfg: Config, options: JobOptions) -> int:
    """The ranks the job starts: the workers on the worker nodes, then the servers on theirs."""
    servers = cfg.ps.servers if options.server_nodes else 0
    return options.nodes * options.tasks_per_node + servers


def stop_time_estimate(cfg: Config) -> float:
    """Seconds from USR1 to a checkpointed exit: the ranks agree to stop at the next log interval,
    so up to ``log.every_steps`` steps (at the slowest step time measured in an earlier run of the
    same run directory, if there is one) plus :data:`BASE_STOP_S`."""
    metrics = run_dir_of(cfg).metrics
    records = read_records(metrics) if metrics.exists() else []
    step_time = max((float(r.get("step_time_s", 0.0)) for r in records), default=0.0)
    return BASE_STOP_S + cfg.log.every_steps * step_time


def check(config_path: str | Path, overrides: Sequence[str] = (),
          options: JobOptions = JobOptions(), script: str | None = None) -> list[str]:
    """Problems with the job script (rendered unless ``script`` is given); an empty list if none."""
    text = render(config_path, overrides, options) if script is None else script
    cfg = load_config(config_path, _job_overrides(overrides, options))
    problems = []
    found = _NP.search(text)
    launched = int(found.group(1) or found.group(2)) if found else None
    ntasks = total_ranks(cfg, options)
    if launched != ntasks:
        servers = f" + {cfg.ps.servers} servers" if options.server_nodes else ""
        problems.append(f"process count: the script starts {launched if found else '?'} ranks but "
                        f"--nodes {options.nodes} x --tasks-per-node {options.tasks_per_node}"
                        f"{servers} = {ntasks}")
    if options.gpus_per_node and options.gpus_per_node != options.tasks_per_node:
        problems.append(f"--gpus-per-node={options.gpus_per_node} but --tasks-per-node="
                        f"{options.tasks_per_node}: hvdtrain runs one rank per GPU")
    problems += _device_problems(cfg.train.device, options.gpus_per_node)
    estimate = stop_time_estimate(cfg)
    if options.signal_lead <= estimate:
        problems.append(f"--signal-lead={options.signal_lead}s does not exceed the estimated stop "
                        f"time of {estimate:.0f}s (checkpoint at the next log interval + shutdown)")
    for value in [str(config_path), *_job_overrides(overrides, options)]:
        if shlex.quote(value) not in text:
            problems.append(f"value {value!r} is not shell-quoted in the script")
    if not problems and shutil.which("sbatch"):
        problems += _sbatch_test_only(text)
    return problems


def _device_problems(device: str, gpus_per_node: int) -> list[str]:
    """``train.device`` against the GPUs the job asks for (the ranks' choice is
    :func:`hvdtrain.device.choose_device` on the GPUs the job script leaves each rank)."""
    if device == "cuda" and not gpus_per_node:
        return ["train.device=cuda but no --gpus-per-node: the ranks would see no GPU and stop"]
    if device == "cpu" and gpus_per_node:
        return [f"train.device=cpu but --gpus-per-node={gpus_per_node}: "
                "the allocated GPUs would sit idle"]
    return []


def _sbatch_test_only(text: str) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch") as handle:
        handle.write(text)
        handle.flush()
        proc = subprocess.run(["sbatch", "--test-only", handle.name], capture_output=True,
                              text=True)
    if proc.returncode != 0:
        return [f"sbatch --test-only rejects it: {(proc.stderr or proc.stdout).strip()}"]
    return []


def submit(config_path: str | Path, overrides: Sequence[str] = (),
       options: JobOptions = JobOptions()) -> str:
    """Writes ``job.sbatch`` into the run directory, submits it and returns the job id."""
    text = render(config_path, overrides, options)
    run_dir = run_dir_of(load_config(config_path, _job_overrides(overrides, options)))
    run_dir.create()  # a log.dir that cannot hold the run: the one-line error `train` gives
    if shutil.which("sbatch") is None:
        raise HvdtrainError("sbatch not found: submit on a Slurm login node (or render the script)")
    path = run_dir.job_script
    try:
        path.write_text(text)
    except OSError as exc:
        raise os_failure(exc, "cannot write the job script", path,
                         "free space (or fix the directory), then submit again") from None
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HvdtrainError(f"sbatch failed: {(proc.stderr or proc.stdout).strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    print(f"[hvdtrain] submitted job {job_id}: script {path}, logs {run_dir.slurm_output(job_id)}, "
          f"outputs in {run_dir.root}")
    return job_id
