"""TLS of the rollout service: certificates from a CA made in the test, servers in this process (no engine: health
checks and Info), who may connect and who is refused; the bind rules; the token kept off command lines."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import types
from pathlib import Path

import grpc
import pytest

from cisjax import errors
from cisjax.commands import remote
from cisjax.rollout import launch
from cisjax.rollout import server as server_lib
from cisjax.rollout.client import RolloutClient, RolloutError
from cisjax.rollout.local_ca import LocalCA
from cisjax.rollout.tls import ClientTLS, ServerTLS

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token-for-tls-tests"
BACKEND = types.SimpleNamespace(  # what Info reads; health checks need nothing
    config_json={},
    engine="fake",
    model="m",
    dtype="float32",
    version=3,
    architecture="A",
    vocab_size=11,
    max_model_len=64,
    phases=None,  # an engine that does not time its prefill and decode apart
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server certificate (localhost, 127.0.0.1) and a client certificate; a second, unrelated CA with a
    client certificate of its own."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = LocalCA(root, "ca"), LocalCA(root, "other_ca")
    return types.SimpleNamespace(
        ca=ca,
        server=ca.issue("server"),
        client=ca.issue("client", names=("trainer",), client=True),
        other=other,
        other_client=other.issue("other_client", names=("trainer",), client=True),
    )


def _serve(tls: ServerTLS | None, *, token=TOKEN, host="127.0.0.1"):
    server, _health, port = server_lib.build_server(
        BACKEND, host=host, port=0, token=token, export_root=None, workers=4, tls=tls
    )
    return server, port


@pytest.fixture(scope="module")
def tls_server(pki):
    server, port = _serve(ServerTLS(pki.server.cert, pki.server.key))
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def mutual_server(pki):
    server, port = _serve(ServerTLS(pki.server.cert, pki.server.key, client_ca=pki.ca.cert))
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _refused(target: str, **client) -> RolloutError:
    """The RolloutError of an Info call that cannot get through (after a short retry)."""
    with RolloutClient(target, token=TOKEN, timeout_s=5.0, retry_s=1.0, **client) as c:
        with pytest.raises(RolloutError) as err:
            c.info()
    return err.value


def test_a_tls_server_serves_a_tls_client(pki, tls_server):
    with RolloutClient(tls_server, token=TOKEN, tls=ClientTLS(pki.ca.cert), timeout_s=10.0) as c:
        assert c.health() == "SERVING"
        assert c.info()["version"] == 3 and c.info()["vocab_size"] == 11
    # reached by a name the certificate carries, through an address it does not: the server name is checked instead
    port = tls_server.rsplit(":", 1)[1]
    tls = ClientTLS(pki.ca.cert, server_name="localhost")
    with RolloutClient(f"127.0.0.1:{port}", token=TOKEN, tls=tls, timeout_s=10.0) as c:
        assert c.info()["engine"] == "fake"


def test_a_plain_client_is_refused_and_told_why(tls_server):
    err = _refused(tls_server)
    assert err.code == grpc.StatusCode.UNAVAILABLE and "plain text" in str(err)
    with RolloutClient(tls_server, timeout_s=5.0) as c:
        with pytest.raises(RolloutError, match="not serving after 1s.*UNAVAILABLE.*plain text"):
            c.wait_ready(1.0)


def test_a_client_trusting_another_ca_is_refused(pki, tls_server):
    err = _refused(tls_server, tls=ClientTLS(pki.other.cert))
    assert err.code == grpc.StatusCode.UNAVAILABLE and "speaks TLS" in str(err)
    # and a server name the certificate does not carry
    err = _refused(tls_server, tls=ClientTLS(pki.ca.cert, server_name="elsewhere.example"))
    assert err.code == grpc.StatusCode.UNAVAILABLE


def test_a_tls_client_of_a_plain_server_is_refused(pki):
    server, port = _serve(None)
    try:
        err = _refused(f"127.0.0.1:{port}", tls=ClientTLS(pki.ca.cert))
        assert err.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_mutual_tls_refuses_a_client_without_a_certificate_the_ca_signed(pki, mutual_server):
    assert _refused(mutual_server, tls=ClientTLS(pki.ca.cert)).code == grpc.StatusCode.UNAVAILABLE
    other = ClientTLS(pki.ca.cert, cert=pki.other_client.cert, key=pki.other_client.key)
    assert _refused(mutual_server, tls=other).code == grpc.StatusCode.UNAVAILABLE
    good = ClientTLS(pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
    with RolloutClient(mutual_server, token=TOKEN, tls=good, timeout_s=10.0) as c:
        assert c.info()["version"] == 3


def test_a_wrong_token_over_tls_is_refused(pki, tls_server):
    for token in (None, "wrong"):
        with RolloutClient(tls_server, token=token, tls=ClientTLS(pki.ca.cert), timeout_s=10.0, retry_s=1.0) as c:
            with pytest.raises(RolloutError) as err:
                c.info()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"  # probes need no token


def test_a_non_localhost_bind_needs_a_token_and_tls(pki):
    tls = ServerTLS(pki.server.cert, pki.server.key)
    with pytest.raises(errors.UserError, match="requires a token"):
        server_lib.check_bind("0.0.0.0", token=None, tls=tls, insecure=False)
    with pytest.raises(errors.UserError, match="without TLS.*--insecure"):
        server_lib.check_bind("0.0.0.0", token=TOKEN, tls=None, insecure=False)
    with pytest.raises(errors.UserError, match="requires a token"):  # --insecure does not waive the token
        server_lib.check_bind("10.1.2.3", token=None, tls=None, insecure=True)
    server_lib.check_bind("0.0.0.0", token=TOKEN, tls=None, insecure=True)
    for host in ("127.0.0.1", "localhost", "::1"):
        server_lib.check_bind(host, token=None, tls=None, insecure=False)
    server, port = _serve(tls, host="0.0.0.0")  # with both: bound on every interface, served over TLS
    try:
        with RolloutClient(f"127.0.0.1:{port}", token=TOKEN, tls=ClientTLS(pki.ca.cert), timeout_s=10.0) as c:
            assert c.info()["version"] == 3
    finally:
        server.stop(0)


def test_bad_certificate_files_are_named_before_anything_binds(pki, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate")
    with pytest.raises(errors.MissingInput, match="--tls-cert .*missing.pem: no such file"):
        _serve(ServerTLS(str(tmp_path / "missing.pem"), pki.server.key))
    with pytest.raises(errors.UserError, match="--tls-key .*notes.txt holds no PEM private key"):
        _serve(ServerTLS(pki.server.cert, str(text)))
    with pytest.raises(errors.UserError, match="--tls-client-ca .*holds no PEM certificate"):
        _serve(ServerTLS(pki.server.cert, pki.server.key, client_ca=str(text)))
    with pytest.raises(errors.MissingInput, match="--tls-ca"):
        RolloutClient("127.0.0.1:1", tls=ClientTLS(str(tmp_path / "missing.pem")))
    with pytest.raises(errors.UserError, match="needs its key"):
        ClientTLS(pki.ca.cert, cert=pki.client.cert)
    with pytest.raises(errors.UserError, match="needs the CA"):
        ClientTLS.of("", cert=pki.client.cert, key=pki.client.key)
    assert ClientTLS.of() is None
    with pytest.raises(errors.UserError, match="rollout.tls_ca"):
        ClientTLS(str(text)).check(("rollout.tls_ca", "rollout.tls_cert", "rollout.tls_key"))


def test_the_token_on_a_command_line_warns_and_children_get_it_in_their_environment(monkeypatch, caplog):
    monkeypatch.setenv(remote.TOKEN_ENV, "from-env")
    with caplog.at_level(logging.WARNING, logger="cisjax"):
        assert remote.token(types.SimpleNamespace(token=None)) == "from-env"
        assert not caplog.records
        assert remote.token(types.SimpleNamespace(token="typed")) == "typed"
    assert "can be read by other users" in caplog.text and "typed" not in caplog.text

    started = {}

    def popen(cmd, env=None, **kw):
        started.update(cmd=cmd, env=env)
        return types.SimpleNamespace(pid=0)

    monkeypatch.setattr(subprocess, "Popen", popen)
    launch.start("transformers", "model", port=1, dtype="float32", token="child-token")
    assert "child-token" not in " ".join(started["cmd"]) and "--token" not in started["cmd"]
    assert started["env"][remote.TOKEN_ENV] == "child-token"
    launch.start("transformers", "model", port=1, dtype="float32")
    assert started["env"][remote.TOKEN_ENV] == ""  # a token meant for a remote server is not the child's


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl on this machine")
def test_the_docs_ca_recipe_makes_certificates_that_work(tmp_path):
    """docs/rollout.md's OpenSSL commands, run as written: mutual TLS with their certificates, the server reached by
    the name its certificate carries."""
    doc = (REPO / "docs" / "rollout.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", doc, flags=re.S) if "openssl req -x509" in b)
    recipe = block[block.index("mkdir -p pki") : block.index("cd ..")]
    subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=tmp_path, check=True, capture_output=True)
    pki = tmp_path / "pki"
    server, port = _serve(ServerTLS(str(pki / "server.pem"), str(pki / "server.key"), client_ca=str(pki / "ca.pem")))
    try:
        tls = ClientTLS(str(pki / "ca.pem"), str(pki / "trainer.pem"), str(pki / "trainer.key"), "rollout-0.internal")
        with RolloutClient(f"127.0.0.1:{port}", token=TOKEN, tls=tls, timeout_s=10.0) as c:
            assert c.info()["version"] == 3
        assert _refused(f"127.0.0.1:{port}", tls=ClientTLS(str(pki / "ca.pem"))).code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_every_client_connects_over_tls(pki, tls_server, mutual_server, tmp_path):
    """The fleet, `cisjax eval`'s service connection and `cisjax mismatch measure`'s, each with its TLS settings."""
    from cisjax.evaluation import served
    from cisjax.mismatch.engines import Servers
    from cisjax.mismatch.spec import MeasureSpec
    from cisjax.rollout.fleet import RolloutFleet

    tls = ClientTLS(pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
    fleet = RolloutFleet.connect([tls_server, mutual_server], token=TOKEN, tls=tls, timeout_s=10.0, retry_s=5.0)
    try:
        fleet.wait_ready(10.0)
        assert fleet.info()["version"] == 3
    finally:
        fleet.close()
    common = dict(model_dir=tmp_path, log_path=tmp_path / "x.log", backend="vllm", dtype="float32", kv_cache_gib=0)
    with served.serving(mutual_server, token=TOKEN, tls=tls, startup_s=10.0, **common) as client:
        assert client.info()["engine"] == "fake"
    with pytest.raises(RolloutError, match="not serving after 1s.*plain text"):
        with served.serving(mutual_server, token=TOKEN, startup_s=1.0, **common):
            pass
    spec = MeasureSpec(out=tmp_path, model=tmp_path, prompts=tmp_path, server=mutual_server, token=TOKEN, tls=tls)
    servers = Servers(spec, tmp_path, vocab_size=11)
    try:  # connected (Info over mutual TLS with the token): the fake engine is then refused as not vLLM
        with pytest.raises(errors.UserError, match="runs the 'fake' engine, expected vllm"):
            servers.client("vllm")
    finally:
        servers.close()


def test_generate_over_tls_end_to_end(pki, tiny_hf_dir, tmp_path, monkeypatch):
    """`cisjax generate --tls-ca` against a TLS server on the transformers engine, the token from the environment."""
    import json

    from cisjax import cli

    backend = server_lib.open_backend("transformers", tiny_hf_dir("qwen2_moe"), dtype="float32")
    server, _health, port = server_lib.build_server(
        backend,
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        export_root=None,
        tls=ServerTLS(pki.server.cert, pki.server.key),
    )
    try:
        (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
        monkeypatch.setenv(remote.TOKEN_ENV, TOKEN)
        argv = ["generate", "--server", f"127.0.0.1:{port}", "--input", str(tmp_path / "in.jsonl")]
        argv += ["--output", str(tmp_path / "out.jsonl"), "--n", "2", "--max-new-tokens", "3", "--seed", "0"]
        assert cli.main([*argv, "--tls-ca", pki.ca.cert]) == 0
        lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and all(len(x["response_ids"]) == 3 for x in lines)
        assert cli.main([*argv, "--retry", "1"]) == 2  # plain text to a TLS server: a one-line error
    finally:
        server.stop(0)
        backend.close()


def test_tls_flags_without_a_running_server_are_refused(pki, tmp_path, capsys):
    """Embedded servers bind 127.0.0.1 in plain text: a CA given to `cisjax eval` or `cisjax mismatch measure` with no
    running server would go unused, and is refused."""
    from cisjax import cli
    from cisjax.mismatch import spec as spec_lib

    argv = ["eval", "--model", str(tmp_path), "--out", str(tmp_path / "out"), "--tls-ca", pki.ca.cert]
    assert cli.main(argv) == 2
    assert "--tls-ca is for --server" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    spec = spec_lib.MeasureSpec(out=tmp_path, model=tmp_path, prompts=tmp_path, tls=ClientTLS(pki.ca.cert))
    with pytest.raises(errors.UserError, match="--tls-ca is for running servers"):
        spec_lib.check(spec)
    spec_lib.check(spec_lib.MeasureSpec(out=tmp_path, model=tmp_path, prompts=tmp_path, jax_server="h:1", tls=spec.tls))


def test_a_token_sent_off_this_machine_in_clear_text_is_warned_about(pki, caplog):
    with caplog.at_level(logging.WARNING, logger="cisjax.rollout.client"):
        RolloutClient("127.0.0.1:1", token=TOKEN).close()
        RolloutClient("10.0.0.5:1").close()  # no token, nothing to leak
        RolloutClient("10.0.0.5:1", token=TOKEN, tls=ClientTLS(pki.ca.cert)).close()
        assert not caplog.records
        RolloutClient("10.0.0.5:1", token=TOKEN).close()
    assert "sending the rollout token to 10.0.0.5:1 in clear text" in caplog.text and TOKEN not in caplog.text
