"""DeploymentSpecs with Serve options that services/app.py does not expose, for tests that need them: custom Ray
resources (to pin a deployment to a node) and Serve's autoscaling metric timings (how often replicas report,
over how long they are averaged), so that a test sees a scaling decision within seconds."""
from __future__ import annotations

import dataclasses


def spec_with(resources: dict | None = None, autoscaling: dict | None = None, **fields):
    """inferscale_server.app.DeploymentSpec(**fields) whose options() also ask for `resources` (custom Ray resources a
    node offers) and override `autoscaling` keys of Serve's autoscaling_config."""
    from inferscale_server.app import DeploymentSpec

    @dataclasses.dataclass
    class Spec(DeploymentSpec):
        def options(self) -> dict:
            opts = super().options()
            if resources:
                opts["ray_actor_options"] = {**opts["ray_actor_options"], "resources": dict(resources)}
            if autoscaling:
                opts["autoscaling_config"] = {**opts["autoscaling_config"], **autoscaling}
            return opts

    return Spec(**fields)
