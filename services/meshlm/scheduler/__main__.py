"""python -m meshlm.scheduler"""

from meshlm.common import config as cfg
from meshlm.common.service import run
from meshlm.scheduler.server import SchedulerConfig, serve


@cfg.command(SchedulerConfig, "meshlm-scheduler")
def main(config: SchedulerConfig) -> None:
    run("scheduler", config, serve)


if __name__ == "__main__":
    main()
