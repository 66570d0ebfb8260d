"""The Fireworks training SDK's objects as `clawbridge up` builds them from the settings: the
serverless service client (built at `start()`: its constructor connects), and a dedicated
deployment's sampler and weight syncer. `backends/fireworks.py` is the backend itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clawbridge.protocol import BackendError

if TYPE_CHECKING:
    from clawbridge.config import Settings

NO_TRAINING_ACCESS = (
    "this Fireworks API key has no Training API access (HTTP {status}). clawbridge needs the "
    "Training API (token-level advantages); without it Fireworks only offers dataset-driven "
    "managed fine-tuning jobs. Ask Fireworks to enable the Training API for your account, or "
    "use --backend tinker|modal|local."
)


def connector(settings: Settings) -> Callable[[], Any]:
    """Builds the serverless `FiretitanServiceClient` when called (its constructor connects)."""

    def connect() -> Any:
        import os

        from fireworks.training.sdk import FiretitanServiceClient

        # base_url always given: otherwise the SDK reads TINKER_BASE_URL.
        return FiretitanServiceClient(base_url=settings.cloud.fireworks_base_url, api_key=os.environ.get("FIREWORKS_API_KEY"))

    return connect


def dedicated_parts(settings: Settings) -> dict[str, Any]:
    """The deployment sampler and weight syncer of a dedicated deployment (real SDK objects)."""
    import os

    from fireworks.training.sdk import DeploymentManager, DeploymentSampler, WeightSyncer

    if not settings.cloud.fireworks_deployment_id:
        raise BackendError("dedicated mode needs --fireworks-deployment-id")
    key = os.environ.get("FIREWORKS_API_KEY", "")
    manager = DeploymentManager(api_key=key, base_url="https://api.fireworks.ai")
    deployment = f"accounts/{manager.account_id}/deployments/{settings.cloud.fireworks_deployment_id}"
    sampler = DeploymentSampler(inference_url="https://api.fireworks.ai/inference", model=deployment, api_key=key)
    return {
        "deployment_sampler": sampler,
        "weight_syncer": lambda training: WeightSyncer(
            policy_client=training, deploy_mgr=manager, deployment_id=settings.cloud.fireworks_deployment_id,
            base_model=settings.cloud.fireworks_base_model, lora_rank=settings.training.lora_rank,
        ),
    }
