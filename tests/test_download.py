"""scripts/download.py against a tiny fake Hugging Face hub on 127.0.0.1 (no real network).

The fake implements what huggingface_hub 2.4's snapshot_download calls:
  GET  /api/models/{repo}/revision/{rev}          -> {"id", "sha", "siblings"}   (HfApi.repo_info)
  GET  /api/models/{repo}/tree/{sha}?recursive=.. -> [{"type","path","size","oid","lfs"?}]  (list_repo_tree)
  HEAD /{repo}/resolve/{sha}/{file}                -> X-Repo-Commit, ETag, Content-Length   (get_hf_file_metadata)
  GET  /{repo}/resolve/{sha}/{file}                -> the bytes                              (http_get)
Errors carry X-Error-Code (GatedRepo / RepoNotFound), which hf_raise_for_status maps to exception classes.
"""
import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save as safetensors_save

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("budgetkv_scripts_download", ROOT / "scripts" / "download.py")
dl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dl)

REPO = "acme/tiny-llama"
SHA = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".bin", ".pth")


def make_repo_files() -> dict[str, bytes]:
    weights = {"tok_embeddings.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    return {
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 4, "vocab_size": 3}).encode(),
        "model.safetensors": safetensors_save(weights),
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
        "tokenizer.model": b"\x0a\x03sp\x00",
        "README.md": b"# tiny\n",
        "pytorch_model.bin": b"PICKLE-NOT-WANTED" * 10,
        "original/consolidated.pth": b"PTH-NOT-WANTED" * 10,
        "original/params.json": b'{"dim": 4}',  # "*.json" matches this too (fnmatch "*" crosses "/")
    }


class FakeHub:
    """mode: "ok" | "gated" (resolve answers 401/403 GatedRepo, like huggingface.co) |
    "gated-api" (the API answers 403 GatedRepo) | "missing" (404 RepoNotFound everywhere)."""

    def __init__(self, files: dict[str, bytes], mode: str = "ok"):
        self.files, self.mode = files, mode
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.requests if method is None or m == method]

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        if path == "/api/agent-harnesses":  # huggingface_hub's best-effort user-agent lookup, once per process
            return self.reply(h, head, 404)
        auth = h.headers.get("Authorization")
        self.requests.append((h.command, path, auth))
        api, resolve = f"/api/models/{REPO}/", f"/{REPO}/resolve/"
        if self.mode == "missing" or not (path.startswith(api) or path.startswith(resolve)):
            return self.reply(h, head, 404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        if self.mode == "gated-api" or (self.mode == "gated" and path.startswith(resolve)):
            msg = f"Access to model {REPO} is restricted and you are not in the authorized list."
            status = 403 if auth or self.mode == "gated-api" else 401
            return self.reply(h, head, status, {"X-Error-Code": "GatedRepo", "X-Error-Message": msg})
        if path.startswith(api + "revision/"):
            info = {"id": REPO, "sha": SHA, "private": False, "gated": self.mode == "gated" and "manual",
                    "siblings": [{"rfilename": f} for f in self.files]}
            return self.reply(h, head, 200, body=json.dumps(info).encode())
        if path.startswith(api + "tree/"):
            tree = [self.tree_entry(f, data) for f, data in self.files.items()]
            return self.reply(h, head, 200, body=json.dumps(tree).encode())
        filename = path[len(resolve):].split("/", 1)[1]
        if filename not in self.files:
            return self.reply(h, head, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA})
        data = self.files[filename]
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{self.etag(filename, data)}"'}
        if filename.endswith(LFS_SUFFIXES):
            headers |= {"X-Linked-Etag": f'"{self.etag(filename, data)}"', "X-Linked-Size": str(len(data))}
        self.reply(h, head, 200, headers, data, content_type="application/octet-stream")

    @staticmethod
    def etag(filename: str, data: bytes) -> str:
        if filename.endswith(LFS_SUFFIXES):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob id

    def tree_entry(self, filename: str, data: bytes) -> dict:
        entry = {"type": "file", "path": filename, "size": len(data),
                 "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if filename.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    @staticmethod
    def reply(h, head, status, headers=None, body=None, content_type="application/json"):
        if body is None:
            body = json.dumps({"error": (headers or {}).get("X-Error-Message", "error")}).encode()
        h.send_response(status)
        for k, v in {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def point_hub_at(monkeypatch, endpoint: str, hf_home: Path) -> None:
    """huggingface_hub reads its env vars once, at import, into `constants`: set both."""
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    patched = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(hf_home / ".agent_harnesses.json"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
        "HF_HUB_ETAG_TIMEOUT": 5,
        "HF_HUB_DOWNLOAD_TIMEOUT": 5,
    }
    for k, v in patched.items():
        monkeypatch.setattr(constants, k, v)


@pytest.fixture
def hub(request, monkeypatch, tmp_path):
    mode, files = getattr(request, "param", ("ok", make_repo_files()))
    with FakeHub(files, mode) as fake:
        point_hub_at(monkeypatch, fake.url, tmp_path / "hf_home")
        yield fake


def test_download_fetches_only_inference_files(hub, tmp_path):
    out = tmp_path / "ckpt"
    assert dl.download(REPO, out) == out.resolve()
    got = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and ".cache" not in p.parts}
    assert got == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"}
    for name in got:
        assert (out / name).read_bytes() == hub.files[name]
    fetched = hub.paths("GET") + hub.paths("HEAD")
    assert not [p for p in fetched if p.endswith((".bin", ".pth", "README.md")) or "/original/" in p], fetched
    assert sorted(p.rsplit("/", 1)[1] for p in hub.paths("GET") if "/resolve/" in p) == sorted(got)
    assert all(auth is None for *_, auth in hub.requests)  # no token anywhere => anonymous


@pytest.mark.parametrize("env_token, arg_token, sent", [("hf_env", None, "hf_env"), ("hf_env", "hf_arg", "hf_arg")])
def test_token_is_sent_as_bearer(hub, tmp_path, monkeypatch, env_token, arg_token, sent):
    monkeypatch.setenv("HF_TOKEN", env_token)
    dl.download(REPO, tmp_path / "ckpt", token=arg_token)
    assert hub.requests and {auth for *_, auth in hub.requests} == {f"Bearer {sent}"}


@pytest.mark.parametrize("hub, token", [(("gated", make_repo_files()), None),  # 401 on resolve
                                        (("gated", make_repo_files()), "hf_not_accepted"),  # 403 on resolve
                                        (("gated-api", make_repo_files()), None)], indirect=["hub"])
def test_gated_repo(hub, tmp_path, token):
    with pytest.raises(dl.DownloadRefused) as err:
        dl.download(REPO, tmp_path / "ckpt", token=token)
    msg = str(err.value)
    assert f"access to {REPO} is refused" in msg and "HF_TOKEN" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("hub", [("missing", {})], indirect=True)
def test_repo_not_found(hub, tmp_path):
    with pytest.raises(dl.DownloadRefused, match="not found") as err:
        dl.download(REPO, tmp_path / "ckpt")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("hub", [("ok", {k: v for k, v in make_repo_files().items() if k != "model.safetensors"})],
                         indirect=True)
def test_repo_without_safetensors(hub, tmp_path):
    with pytest.raises(dl.DownloadRefused, match="has no safetensors weights"):
        dl.download(REPO, tmp_path / "ckpt")
    assert not [p for p in hub.paths() if p.endswith(".bin")]


def test_unreachable_hub(monkeypatch, tmp_path):
    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    point_hub_at(monkeypatch, f"http://127.0.0.1:{port}", tmp_path / "hf_home")
    with pytest.raises(dl.DownloadError) as err:
        dl.download(REPO, tmp_path / "ckpt")
    msg = str(err.value)
    assert "cannot reach the Hugging Face hub" in msg and f"127.0.0.1:{port}" in msg and "--checkpoint" in msg, msg
    assert "\n" not in msg


def _run_cli(hub_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {"HF_ENDPOINT": hub_url, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "scripts/download.py", "--repo-id", REPO, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("hub", [("gated", make_repo_files())], indirect=True)
def test_cli_gated_exits_2_with_one_line(hub, tmp_path):
    r = _run_cli(hub.url, tmp_path, "--out-dir", str(tmp_path / "ckpt"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "HF_TOKEN" in r.stderr and r.stdout == ""


def test_cli_unreachable_hub_exits_1(tmp_path):  # the environment failed, not the input (docs/errors.md)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run_cli(f"http://127.0.0.1:{port}", tmp_path, "--out-dir", str(tmp_path / "ckpt"))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot reach the Hugging Face hub" in r.stderr


def test_cli_success_prints_path(hub, tmp_path):
    out = tmp_path / "ckpt"
    r = _run_cli(hub.url, tmp_path, "--out-dir", str(out), "--hf-token", "hf_cli")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out.resolve())
    assert (out / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert {auth for *_, auth in hub.requests} == {"Bearer hf_cli"}
