"""The ingress's FastAPI app, shared by the modules that add routes to it."""

from fastapi import FastAPI

app = FastAPI(title="Rollout Platform", version="1")
