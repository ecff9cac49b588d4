"""`modelpool traces`: list the public traces the readers know; `modelpool traces fetch NAME` downloads one.

A download goes to the user cache (`sims.trace_store.cache_dir`, or
`--dir`) under the same relative path the readers look for, through a
`.part` file: an interrupted fetch resumes from where it stopped (HTTP
Range), and a file is moved into place only once its size and sha256 match
the shipped manifest. `--mirror URL` (or $MODELPOOL_TRACES_MIRROR) fetches
from a server laid out like a traces folder instead of each file's GitHub
source: an internal mirror, or a loopback server in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from sims.trace_store import CACHE_ENV, CATALOGUE, SHIPPED, TRACES_ENV, Trace, TraceFile, cache_dir, search_dirs, sha256_of, where

MIRROR_ENV = "MODELPOOL_TRACES_MIRROR"
console = Console()
app = typer.Typer(add_completion=False, invoke_without_command=True,
                  help="List the public traces the readers know; `fetch NAME` downloads one into the cache.")


class FetchError(RuntimeError):
    """A download that failed or did not match its checksum; the message names the file and the URL."""


def file_url(file: TraceFile, mirror: str | None) -> str:
    return f"{mirror.rstrip('/')}/{file.path}" if mirror else file.url


def fetch_file(file: TraceFile, dest: Path, mirror: str | None = None,
               advance: Callable[[int], None] = lambda num_bytes: None, timeout_s: float = 60.0) -> Path:
    """Download `file` to `dest / file.path` unless a verified copy is there; resume a `.part` left by a stop."""
    target = dest / file.path
    if target.is_file() and target.stat().st_size == file.num_bytes and sha256_of(target) == file.sha256:
        advance(file.num_bytes)
        return target
    part = target.with_name(target.name + ".part")
    offset = part.stat().st_size if part.is_file() else 0
    if offset > file.num_bytes:
        offset = 0
    url = file_url(file, mirror)
    if offset < file.num_bytes:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=timeout_s) as response:
                if response.status_code not in (200, 206):
                    raise FetchError(f"{file.path}: {url} answered HTTP {response.status_code}")
                if response.status_code == 200:  # the server sent it all: start over
                    offset = 0
                elif not response.headers.get("content-range", "").startswith(f"bytes {offset}-"):
                    raise FetchError(f"{file.path}: {url} answered range {response.headers.get('content-range')!r} "
                                     f"to a request from byte {offset}")
                advance(offset)
                target.parent.mkdir(parents=True, exist_ok=True)  # only once a server answers: no empty folders
                with open(part, "r+b" if offset else "wb") as out:
                    out.seek(offset)
                    out.truncate()
                    for chunk in response.iter_bytes():  # as they arrive: a dropped link keeps what came
                        out.write(chunk)
                        advance(len(chunk))
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError) as error:
            raise FetchError(_unreachable(file, url, mirror, error)) from None
        except httpx.HTTPError as error:
            raise FetchError(f"{file.path}: {url}: {error} (run the fetch again to resume)") from None
    else:
        advance(offset)
    digest, num_bytes = sha256_of(part), part.stat().st_size
    if digest != file.sha256:
        part.unlink()
        raise FetchError(f"{file.path}: checksum mismatch: {url} gave {num_bytes} bytes with sha256 {digest}, "
                         f"expected {file.num_bytes} bytes with sha256 {file.sha256}; the download was removed")
    part.replace(target)
    return target


def _unreachable(file: TraceFile, url: str, mirror: str | None, error: Exception) -> str:
    """No server answered: offline, a firewall, or a wrong mirror. Say which ways around it there are."""
    host = httpx.URL(url).host
    if mirror:
        where = (f"the mirror {mirror} (--mirror or ${MIRROR_ENV}) is unreachable: check its address, or unset it "
                 f"to fetch from each file's GitHub source")
    else:
        where = (f"no network to {host}? Fetch from a server you can reach, laid out like a traces folder "
                 f"(`--mirror URL` or ${MIRROR_ENV}), or copy the files by hand into a folder and point "
                 f"${TRACES_ENV} at it")
    return f"{file.path}: cannot reach {host} ({error}): {where}"


def fetch(traces: Sequence[Trace], dest: Path, mirror: str | None = None, quiet: bool = False) -> list[Path]:
    """Every file of `traces` into `dest`, with one progress bar over their bytes."""
    files = list({file.path: file for trace in traces for file in trace.files}.values())
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, disable=quiet) as bar:
        task = bar.add_task(", ".join(t.name for t in traces), total=sum(file.num_bytes for file in files))
        return [fetch_file(file, dest, mirror, lambda num: bar.advance(task, num)) for file in files]


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 1e5 else f"{num_bytes / 1e3:.0f} KB"


@app.callback()
def list_traces(ctx: typer.Context) -> None:
    """Every trace the readers know: what it is, its source and license, its size, and where it is if present."""
    if ctx.invoked_subcommand:
        return
    for trace in CATALOGUE.values():
        folder, count = where(trace)
        if trace.shipped:
            here, size = f"shipped: {SHIPPED / trace.shipped}", _size((SHIPPED / trace.shipped).stat().st_size)
        else:
            size = _size(trace.num_bytes)
            partial = "" if count == len(trace.files) else f" (partial: {count} of {len(trace.files)} files)"
            here = "not here: `modelpool traces fetch " + trace.name + "`" if folder is None else f"in {folder}{partial}"
        typer.echo(f"{trace.name:30s} {size:>8s}  {here}\n    {trace.description}\n"
                   f"    source github.com/{trace.origin.repo} at {trace.origin.commit[:10]}; license {trace.origin.license}")
    typer.echo(f"\nLooked in {', '.join(map(str, search_dirs()))}. `modelpool traces fetch NAME` downloads into "
               f"{cache_dir()} (${CACHE_ENV}); ${TRACES_ENV} names a folder of your own copies. Your own trace: "
               "`--trace PATH` (CSV or JSONL with timestamp_s, model, input_tokens, output_tokens, or a format above).")


@app.command("fetch")
def fetch_command(
    names: list[str] = typer.Argument(..., help="Trace names, as `modelpool traces` lists them."),
    folder: Path | None = typer.Option(None, "--dir", help="Download here instead of the cache "
                                       "($MODELPOOL_TRACES_CACHE, default ~/.cache/modelpool/traces)."),
    mirror: str | None = typer.Option(None, "--mirror", envvar=MIRROR_ENV, help="Fetch from this base URL, laid "
                                      "out like a traces folder, instead of each file's GitHub source."),
) -> None:
    """Download traces from their public sources; resumable, each file checked against its sha256."""
    unknown = [name for name in names if name not in CATALOGUE]
    if unknown:
        typer.echo(f"error: unknown trace {unknown[0]!r}; known: {', '.join(CATALOGUE)}", err=True)
        raise typer.Exit(1)
    dest = (folder or cache_dir()).expanduser()
    try:
        paths = fetch([CATALOGUE[name] for name in names], dest, mirror, quiet=not console.is_terminal)
    except (FetchError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    console.print(f"{len(paths)} file(s) of {', '.join(names)} verified in {dest}")
    if folder is not None and folder.expanduser().resolve() not in search_dirs():
        console.print(f"the readers look in {cache_dir()} and $MODELPOOL_TRACES: "
                      f"export MODELPOOL_TRACES={dest} to use this copy")
