"""A module whose body starts a pool, as some users' modules do (see
``test_a_pool_started_by_a_module_body_in_a_worker_names_that_module``): never imported by the
test process itself, only by a worker, as a task's import of it."""

import mpsched

POOL = mpsched.Pool(1, start_method="forkserver")
