"""stagecheck's SLURM launcher for Hydra: `hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml).

Hydra instantiates launchers only from this namespace package, so the class lives here; what it changes
(the wait for the jobs) and why is in sweep/slurm_launcher.py.
"""

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from omegaconf import OmegaConf

from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

log = logging.getLogger(__name__)


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # The plugin's launch(), up to the submission, unchanged (hydra-submitit-launcher 1.2.0, MIT licence).
        import submitit

        assert self.config is not None
        params = self.params
        init_keys = {"max_num_timeout", "submitit_folder"}
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR,
            folder=params["submitit_folder"],
            **{f"{self._EXECUTOR}_max_num_timeout": params[k] for k in ("max_num_timeout",) if k in params},
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items() if k not in init_keys}
        )

        sweep_dir = Path(str(self.config.hydra.sweep.dir))  # resolved once, here (sweep/slurm_launcher.py)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))

        # Up to here the plugin's code; stagecheck's: a sweep submitted again into its directory submits only the
        # jobs that have not finished there. (Imported here, not at Hydra's plugin scan.)
        from sweep import slurm_launcher

        loader = self.hydra_context.config_loader
        done = slurm_launcher.finished_jobs(loader, self.config, job_overrides, initial_job_idx, sweep_dir)
        job_params: list[Any] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            if idx in done:
                log.info(f"\t#{idx} : already finished in {done[idx]}: not submitted")
                continue
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*job_params)) if job_params else []
        if jobs:
            log.info(f"submitted SLURM job(s) {', '.join(j.job_id for j in jobs)}; logs in {params['submitit_folder']}")

        slurm_launcher.wait_until_ended(jobs)
        submitted = {job_param[2]: job for job_param, job in zip(job_params, jobs)}  # by job number
        return [
            slurm_launcher.skipped_return(overrides, done[idx])
            if idx in done
            else slurm_launcher.job_return(submitted[idx], idx, overrides)
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx)
        ]
