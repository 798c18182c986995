# Routers (stateless; leases live in JetStream KV so replicas agree) behind an nginx load balancer whose
# upstream list is rendered from Consul's healthy "talaria-router" instances.
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
variable "router_count" {
  type    = number
  default = 2
}
variable "lb_port" {
  type    = number
  default = 8080
}

job "talaria-routers" {
  datacenters = var.datacenters
  type        = "service"

  update {
    max_parallel      = 1
    canary            = 1
    auto_promote      = true
    auto_revert       = true
    health_check      = "checks"
    min_healthy_time  = "10s"
    healthy_deadline  = "2m"
    progress_deadline = "5m"
  }

  group "router" {
    count = var.router_count

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      mode = "bridge"
      port "http" { to = 8000 }
    }

    restart {
      attempts = 5
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    service {
      name     = "talaria-router"
      port     = "http"
      provider = "consul"

      # Ready = NATS connected and at least one engine healthy: only then does the LB send traffic.
      check {
        name     = "ready"
        type     = "http"
        path     = "/ready"
        interval = "5s"
        timeout  = "2s"
      }

      # Alive = the process answers and NATS is connected; restart it otherwise.
      check {
        name     = "health"
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "3s"
        check_restart {
          limit = 3
          grace = "30s"
        }
      }
    }

    task "router" {
      driver       = "docker"
      kill_timeout = "35s"

      config {
        image = var.image
        ports = ["http"]
        args  = ["router", "--config", "/local/cluster.yaml", "--host", "0.0.0.0", "--port", "8000"]
      }

      env {
        NATS_URL            = var.nats_url
        TALARIA__ROUTER__ID = "router-${NOMAD_ALLOC_INDEX}"
        OTEL_SERVICE_NAME   = "talaria-router"
        # secure by default: no API key (nomad var api_key) = the router refuses to start; an open API
        # needs TALARIA_OPEN_API = "true" here, which the router logs as a warning
        TALARIA__ROUTER__AUTH__REQUIRE_KEYS = "true"
      }

      template {
        destination = "local/cluster.yaml"
        data        = <<-EOT
        namespace: ${var.namespace}
        router: {host: 0.0.0.0, port: 8000, heartbeat_miss_limit: 3, accept_timeout_s: 10}
        engines: []
        EOT
      }

      template {
        destination = "secrets/nats.env"
        env         = true
        data        = <<-EOT
        {{ with nomadVar "nomad/jobs" }}TALARIA__NATS__USER={{ .nats_user }}
        TALARIA__NATS__PASSWORD={{ .nats_password }}
        TALARIA_API_KEY={{ .api_key }}
        TALARIA__ROUTER__AUTH__RESUME_SECRET={{ .resume_secret }}{{ end }}
        EOT
      }

      resources {
        cpu    = 2000
        memory = 1024
      }
    }
  }

  group "lb" {
    count = 1

    network {
      port "http" { static = var.lb_port }
    }

    restart {
      attempts = 5
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    service {
      name     = "talaria-lb"
      port     = "http"
      provider = "consul"
      check {
        name     = "lb-health"
        type     = "http"
        path     = "/lb-health"
        interval = "5s"
        timeout  = "2s"
      }
    }

    task "nginx" {
      driver = "docker"

      config {
        image   = "nginx:1.27-alpine"
        ports   = ["http"]
        volumes = ["local/talaria.conf:/etc/nginx/conf.d/talaria.conf", "local/upstreams.inc:/etc/nginx/conf.d/upstreams.inc"]
      }

      template {
        destination   = "local/upstreams.inc"
        change_mode   = "signal"
        change_signal = "SIGHUP"
        data          = <<-EOT
        {{ range service "talaria-router" }}server {{ .Address }}:{{ .Port }} max_fails=2 fail_timeout=5s;
        {{ else }}server 127.0.0.1:65535 down;{{ end }}
        EOT
      }

      template {
        destination     = "local/talaria.conf"
        left_delimiter  = "[["
        right_delimiter = "]]"
        data            = replace(file("../nginx/nomad.conf.template"), "$${LB_PORT}", tostring(var.lb_port))
      }

      resources {
        cpu    = 500
        memory = 128
      }
    }
  }
}
