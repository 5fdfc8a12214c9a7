"""`cuda-agent tasks download kernelbench` against a real HTTP server on loopback serving archives the
tests build; the loader then finds the suite in the cache with ../shared hidden."""

import functools
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cuda_agent.cli import app
from tasks import kernelbench
from tasks.kernelbench import DOWNLOAD_COMMAND, DownloadError, download_kernelbench, installed_root

FIXTURE = Path(__file__).parent / "fixtures" / "cpu_multi" / "small_task.py"
TOP = f"KernelBench-{kernelbench.COMMIT}"


def _problems() -> dict[str, bytes]:
    src = FIXTURE.read_bytes()
    return {"level1/1_Small.py": src, "level1/2_Other.py": src.replace(b"class Model", b"# two\nclass Model"),
            "level2/1_Fused.py": src, "LICENSE": b"MIT License\n"}


def _manifest(files: dict[str, bytes]) -> dict[str, str]:
    return {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _upstream_layout(files: dict[str, bytes]) -> dict[str, bytes]:
    out = {f"{TOP}/README.md": b"upstream readme", f"{TOP}/KernelBench/level4/1_Big.py": b"not ours"}
    for name, data in files.items():
        out[f"{TOP}/{name}" if name == "LICENSE" else f"{TOP}/KernelBench/{name}"] = data
    return out


@pytest.fixture
def server(tmp_path):
    """A file server on loopback serving tmp_path/www; yields (folder, base URL)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    t.join()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    c = tmp_path / "cache"
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(c))
    monkeypatch.setenv("CUDA_AGENT_KERNELBENCH", str(tmp_path / "no-such-kernelbench"))  # hides ../shared
    return c


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cuda_agent", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_download_installs_verified_files_and_the_loader_uses_them(server, cache, tmp_path, monkeypatch):
    www, base = server
    files = _problems()
    _tar(www / "kb.tar.gz", _upstream_layout(files))
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"files": _manifest(files)}))
    monkeypatch.setattr(kernelbench, "MANIFEST_PATH", manifest)

    r = CliRunner().invoke(app, ["tasks", "download", "kernelbench", "--url", f"{base}/kb.tar.gz"])
    assert r.exit_code == 0, r.output
    root = installed_root()
    assert str(root) in r.output and root.is_relative_to(cache)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == sorted(files)
    assert not (root / "level4").exists()  # only what the manifest vouches for is installed
    assert (root / "level1" / "2_Other.py").read_bytes() == files["level1/2_Other.py"]

    # a fresh process (no monkeypatching) with ../shared hidden finds the suite in the cache
    r = cli("tasks", "kernelbench:level1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["kernelbench/level1/1_Small", "kernelbench/level1/2_Other"]
    r = cli("init", "kernelbench/level1/2_Other", tmp_path / "ws", "--backend", "cpu", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "ws" / "model.py").read_bytes() == files["level1/2_Other.py"]

    # downloading again replaces the install whole
    (root / "level1" / "stray.py").write_text("x")
    assert CliRunner().invoke(app, ["tasks", "download", "kernelbench", "--url", f"{base}/kb.tar.gz"]).exit_code == 0
    assert not (root / "level1" / "stray.py").exists()


def test_checksum_mismatch_is_refused_and_nothing_is_installed(server, cache):
    www, base = server
    files = _problems()
    manifest = _manifest(files)
    tampered = {**files, "level1/1_Small.py": files["level1/1_Small.py"] + b"\nimport os\n"}
    _tar(www / "bad.tar.gz", _upstream_layout(tampered))
    with pytest.raises(DownloadError, match=r"differ.*level1/1_Small.py.*nothing was installed"):
        download_kernelbench(f"{base}/bad.tar.gz", manifest=manifest)
    assert not installed_root().exists()
    assert list((cache / "kernelbench").iterdir()) == []  # no temp files left behind

    # a good install survives a later bad download untouched
    _tar(www / "good.tar.gz", _upstream_layout(files))
    root = download_kernelbench(f"{base}/good.tar.gz", manifest=manifest)
    with pytest.raises(DownloadError, match="differ"):
        download_kernelbench(f"{base}/bad.tar.gz", manifest=manifest)
    assert (root / "level1" / "1_Small.py").read_bytes() == files["level1/1_Small.py"]

    # a file the manifest needs but the archive lacks is refused too
    del files["level2/1_Fused.py"]
    _tar(www / "short.tar.gz", _upstream_layout(files))
    with pytest.raises(DownloadError, match=r"missing \(level2/1_Fused.py\)"):
        download_kernelbench(f"{base}/short.tar.gz", manifest=manifest)


@pytest.mark.parametrize("evil", ["../escape.py", "/tmp/abs_escape.py", f"{TOP}/../../escape.py"])
def test_archive_with_a_path_escape_is_refused(server, cache, tmp_path, evil):
    www, base = server
    files = _problems()
    _tar(www / "evil.tar.gz", {**_upstream_layout(files), evil: b"import os; os.system('true')\n"})
    with pytest.raises(DownloadError, match="leaves the archive"):
        download_kernelbench(f"{base}/evil.tar.gz", manifest=_manifest(files))
    assert not installed_root().exists()
    assert not list(tmp_path.rglob("escape.py")) and not Path("/tmp/abs_escape.py").exists()


def test_zip_archives_and_links(server, cache):
    www, base = server
    files = _problems()
    with zipfile.ZipFile(www / "kb.zip", "w") as zf:
        for name, data in _upstream_layout(files).items():
            zf.writestr(name, data)
    assert (download_kernelbench(f"{base}/kb.zip", manifest=_manifest(files)) / "level2" / "1_Fused.py").is_file()

    with zipfile.ZipFile(www / "evil.zip", "w") as zf:
        zf.writestr("../../escape.py", b"x")
    with pytest.raises(DownloadError, match="leaves the archive"):
        download_kernelbench(f"{base}/evil.zip", manifest=_manifest(files))

    with tarfile.open(www / "link.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo(f"{TOP}/KernelBench/level1/3_Link.py")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(info)
    with pytest.raises(DownloadError, match="links to"):
        download_kernelbench(f"{base}/link.tar.gz", manifest=_manifest(files))


def test_http_errors_and_non_archives_fail_cleanly(server, cache):
    www, base = server
    r = CliRunner().invoke(app, ["tasks", "download", "kernelbench", "--url", f"{base}/missing.tar.gz"])
    assert r.exit_code == 1 and "HTTP 404" in r.output
    (www / "page.html").write_text("<html>not an archive</html>")
    with pytest.raises(DownloadError, match="not a tar or zip archive"):
        download_kernelbench(f"{base}/page.html", manifest={})
    assert not installed_root().exists()
    r = CliRunner().invoke(app, ["tasks", "download", "pytorchbench"])
    assert r.exit_code == 2 and DOWNLOAD_COMMAND in r.output


def test_every_missing_suite_message_names_the_download_command(cache, tmp_path):
    for args in (["tasks", "kernelbench:level1"], ["tasks", "kernelbench"],
                 ["init", "kernelbench/level1/19_ReLU", tmp_path / "ws"]):
        r = cli(*args)
        assert r.returncode == 2 and DOWNLOAD_COMMAND in r.stderr, (args, r.stderr)
    assert cli("tasks", "example/swish_bias").returncode == 0  # listing other things still works


def test_kept_manifest_pins_the_upstream_levels():
    """The checksums in the repository cover KernelBench's 250 level 1-3 problems."""
    manifest = kernelbench.load_manifest()
    assert sum(n.startswith(("level1/", "level2/", "level3/")) for n in manifest) == 250
    assert json.loads(kernelbench.MANIFEST_PATH.read_text())["commit"] == kernelbench.COMMIT


def test_kept_manifest_matches_the_real_suite(real_kernelbench):
    assert kernelbench.manifest_of(real_kernelbench) == kernelbench.load_manifest()


def test_the_real_manifest_accepts_an_upstream_shaped_archive(server, real_kernelbench, cache):
    www, base = server
    files = {n: (real_kernelbench / n).read_bytes() for n in kernelbench.load_manifest()}
    _tar(www / f"{kernelbench.COMMIT}.tar.gz", _upstream_layout(files))
    root = download_kernelbench(f"{base}/{kernelbench.COMMIT}.tar.gz")
    assert len(list((root / "level3").glob("*.py"))) == 50
