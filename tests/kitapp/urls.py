from django.urls import path

from tests.kitapp import views

urlpatterns = [path("prices/refresh/", views.refresh_prices)]
