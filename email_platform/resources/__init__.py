"""Dagster resources: the seams through which ops, sensors and assets reach the outside."""

from email_platform.resources.database import AppDatabase
from email_platform.resources.lanes import LanePolicy
from email_platform.resources.provider import EmailProviderResource
from email_platform.resources.routing import RoutingResource
from email_platform.resources.warehouse import Warehouse

__all__ = ["AppDatabase", "EmailProviderResource", "LanePolicy", "RoutingResource", "Warehouse"]
