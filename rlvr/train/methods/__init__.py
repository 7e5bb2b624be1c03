"""Training methods composed beside the core step (rlvr.train.loop.train_step).

The core step names no method: it collects groups, updates the policy, hands the new weights to
the engine, lets the sampler observe, and logs. A method whose data flow differs plugs in
through these seams, and only these (each optional; `Method` does nothing by default):

    sampling(params, step) -> params           how the step's rollouts are sampled (a staged length)
    rescore(run, groups, examples, held_out)   rewards that need the policy itself, filled in
                                               after sampling (training, and held-out evaluation)
    prepare(run, plan, step) -> plan           before the update: the groups it trains on, its
                                               settings, its extra inputs (a reference model, a
                                               critic's credit, demonstrations, stored samples)
    after_update(run, plan, metrics, step)     after the update, before the weights reach the
                                               engine; returns metrics of its own
    metrics(run)                               metrics every step logs
    save_after(step) -> bool                   a checkpoint after this step (long work just done)
    state_dict() / load_state_dict(state)      what a checkpoint keeps, under `state_key`
    task(task)                                 once at setup: the training data it leaves to RL

A method is built by its factory in METHODS (rlvr.train.methods.registry) from the run (its other parts are set up) and
`SetupInfo`; a factory returns None when the config does not ask for its method. The hooks run in
the order of METHODS.

A method whose update needs a part of its own on every learner rank (a reference model, a
critic, a teacher) builds it in a function of ``(cfg, policy, RankInfo) -> Extras | None`` in
ON_RANKS, and its factory builds its local part through that same function: data-parallel
learner ranks (rlvr.scaleout.learners) call `rank_extras`, and never name a method.
"""

from rlvr.train.methods.base import Extras, Method, Plan, RankInfo, SetupInfo, example_fields, fields_by_id

__all__ = ["Extras", "Method", "Plan", "RankInfo", "SetupInfo", "example_fields", "fields_by_id"]
