"""The dashboard's pages (filled in by serve/dashboard_pages.py)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
