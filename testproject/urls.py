from django.contrib import admin
from django.urls import path

from testproject.example import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("counter/increment/", views.increment_counter, name="increment-counter"),
]
