"""The four policies behind one contract."""

from scheduler.policies.base import InstanceState, PolicyBase
from scheduler.policies.dedicated import DedicatedPolicy
from scheduler.policies.request_level import RequestLevelPolicy
from scheduler.policies.spatial import SpatialPolicy
from scheduler.policies.token_level import TokenLevelPolicy

POLICIES: dict[str, type[PolicyBase]] = {
    p.name: p for p in (DedicatedPolicy, RequestLevelPolicy, SpatialPolicy, TokenLevelPolicy)
}

__all__ = ["POLICIES", "InstanceState", "PolicyBase", "DedicatedPolicy", "RequestLevelPolicy", "SpatialPolicy",
           "TokenLevelPolicy"]
