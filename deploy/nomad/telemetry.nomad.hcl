# Telemetry service (heartbeats, hooks, rounds, switches -> SCT, Prometheus /metrics) and the OpenTelemetry
# Collector every service exports OTLP to. Prometheus and Grafana: see deploy/README.md (operators usually
# run their own; deploy/prometheus and deploy/grafana hold the scrape config and provisioning).
variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}
variable "image" {
  type    = string
  default = "talaria:cpu"
}
variable "nats_url" {
  type = string
}
variable "namespace" {
  type    = string
  default = "talaria"
}
variable "otelcol_image" {
  type    = string
  default = "otel/opentelemetry-collector-contrib:0.120.0"
}
variable "traces_backend" {
  type        = string
  default     = "jaeger.service.consul:4317"
  description = "OTLP/gRPC endpoint of the trace store"
}

job "talaria-telemetry" {
  datacenters = var.datacenters
  type        = "service"

  update {
    max_parallel     = 1
    health_check     = "checks"
    min_healthy_time = "10s"
    healthy_deadline = "3m"
    auto_revert      = true
  }

  group "telemetry" {
    count = 1

    network {
      port "metrics" { to = 9464 }
    }

    restart {
      attempts = 5
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    service {
      name     = "talaria-telemetry"
      port     = "metrics"
      provider = "consul"
      tags     = ["prometheus"]
      check {
        name     = "metrics"
        type     = "http"
        path     = "/metrics"
        interval = "10s"
        timeout  = "3s"
      }
    }

    task "telemetry" {
      driver = "docker"

      config {
        image = var.image
        ports = ["metrics"]
        args  = ["telemetry", "--config", "/local/cluster.yaml", "--host", "0.0.0.0", "--port", "9464"]
      }

      env {
        NATS_URL          = var.nats_url
        OTEL_SERVICE_NAME = "talaria-telemetry"
      }

      template {
        destination = "local/otlp.env"
        env         = true
        data        = <<-EOT
        {{ range service "talaria-otelcol" }}OTEL_EXPORTER_OTLP_ENDPOINT=http://{{ .Address }}:{{ .Port }}
        {{ end }}
        EOT
      }

      template {
        destination = "local/cluster.yaml"
        data        = <<-EOT
        namespace: ${var.namespace}
        engines: []
        EOT
      }

      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
        {{ with nomadVar "nomad/jobs" }}TALARIA__NATS__USER={{ .nats_user }}
        TALARIA__NATS__PASSWORD={{ .nats_password }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "otelcol" {
    count = 1

    network {
      port "otlp_grpc" { static = 4317 }
      port "otlp_http" { static = 4318 }
      port "prom" { to = 8889 }
      port "health" { to = 13133 }
    }

    restart {
      attempts = 5
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    service {
      name     = "talaria-otelcol"
      port     = "otlp_grpc"
      provider = "consul"
      check {
        name     = "collector-health"
        type     = "http"
        port     = "health"
        path     = "/"
        interval = "10s"
        timeout  = "3s"
      }
    }

    service {
      name     = "talaria-otelcol-metrics"
      port     = "prom"
      provider = "consul"
      tags     = ["prometheus"]
    }

    task "otelcol" {
      driver = "docker"

      config {
        image = var.otelcol_image
        ports = ["otlp_grpc", "otlp_http", "prom", "health"]
        args  = ["--config=/local/collector.yaml"]
      }

      env {
        OTEL_TRACES_BACKEND   = var.traces_backend
        OTEL_MEMORY_LIMIT_MIB = "1024"
      }

      template {
        destination     = "local/collector.yaml"
        left_delimiter  = "[["
        right_delimiter = "]]"
        data            = file("../otel/collector.yaml")
      }

      resources {
        cpu    = 1000
        memory = 1536
      }
    }
  }
}
