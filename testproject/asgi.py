"""The test project's ASGI application: ``uvicorn testproject.asgi:application``."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
application = get_asgi_application()
