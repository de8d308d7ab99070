"""openrlhf-lopti: Advantage Reweighting and Low-Probability Token Isolation for OpenRLHF."""

__version__ = "0.1.0"
