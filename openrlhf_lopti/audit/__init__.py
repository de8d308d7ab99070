"""Token-probability diagnostics (paper Fig. 1(d) and Fig. 3): gradient norms and update directions per
probability bin. ``measure`` computes, ``report`` writes JSON / table / PNG, ``cli`` is ``openrlhf-lopti audit``.

It drives the local trainer's own rollout and update code (``openrlhf_lopti.local``), so the update it
audits is exactly the one training performs.
"""
