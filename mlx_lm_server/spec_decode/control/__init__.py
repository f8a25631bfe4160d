"""When to speculate and how far: the controller and what it learns from
(step costs, acceptance estimates, shadow drafts, start-up calibration, the
timing of real steps)."""
