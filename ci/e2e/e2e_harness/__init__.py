"""The end-to-end harness behind ci/e2e/run_e2e.py (which parses the command line, plans, runs
and reports), one module per concern:

- models.py: the tiny models the servers load; MODELS, one row per model family (config,
  weights' names and shapes, the flags its GPU runs add).
- traffic.py: what a run sends (Request) and gets back (Outcome), the traffic planners, and
  sending the waves within bounds (generate, drive).
- scenarios.py: what a run's server is given and sent (Scenario: flags, traffic, where the misses
  come from, the model, the first sglang line it runs on): HICACHE, NATURAL, LFM2.
- server.py: the server's command line, its environment on CPU, its process group, its memory.
- verdicts.py: the kinds of run, a run's record (Run), the hook's counters, and judge.
- plan.py: RunSpec and CPU_PLAN (the CPU runs, one row each, in the order they run), and the
  command line turned into the servers to start (plan_cpu, plan_gpu).
- runner.py: one run (run_once) and every run of a plan in order (run_plans).
- report.py: report.json, report.md and the printed table.

Each imports only those above it in that list (report: verdicts only), so none imports in a
cycle.

A new model family: its config and weights' shapes and its row in models.MODELS; a Scenario in
scenarios.py that serves it (`model=`), with its flags and its traffic; and its runs in
plan.CPU_PLAN, each control before the runs compared with it. --models, --runs and the report
take it from there. A new kind of run (as the natural runs were) is a Scenario (its planner in
traffic.py when the traffic is new) and its rows in CPU_PLAN; a new expectation is a kind in
verdicts.py and its branch of judge.

The traffic's sizes (traffic.GROUPS, ROUNDS, NATURAL_SHORT_REQUESTS, ...) are read from
traffic.py when a planner is called: a test that shrinks the traffic sets them there.
"""
