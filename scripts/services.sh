#!/usr/bin/env bash
# Local services for dedupe-worker: PostgreSQL 15, RabbitMQ and Apache Kafka (KRaft, one node).
#
#   scripts/services.sh [up|down|status] [postgres] [rabbitmq] [kafka]
#
# `up` is the default command; no service names means all three. Idempotent: `up` starts only
# what is not running and installs only what is missing (Debian packages: postgresql,
# rabbitmq-server; Kafka jars from Maven Central via scripts/kafka/pom.xml). Every wait is bounded.
#
#   PostgreSQL  postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe   (role dedupe: LOGIN CREATEDB)
#   RabbitMQ    amqp://guest:guest@127.0.0.1:5672/
#   Kafka       127.0.0.1:9092                                    (controller on 127.0.0.1:9093)
#
# Environment:
#   DEDUPE_SERVICES_DIR  run-time state (Kafka config, data, log, pid)  default <repo>/.services
#   DEDUPE_CACHE_DIR     downloaded Kafka jars                          default <repo>/.cache
#   JAVA_HOME            Java 17+ to run Kafka (default: java on PATH)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERVICES_DIR="${DEDUPE_SERVICES_DIR:-$ROOT/.services}"
CACHE_DIR="${DEDUPE_CACHE_DIR:-$ROOT/.cache}"

PG_VERSION=15
PG_CLUSTER=main
PG_PORT=5432
PG_DSN="postgresql://dedupe:dedupe@127.0.0.1:${PG_PORT}/dedupe"
PG_CONF_DROPIN="/etc/postgresql/${PG_VERSION}/${PG_CLUSTER}/conf.d/dedupe-worker.conf"

AMQP_URL="amqp://guest:guest@127.0.0.1:5672/"

KAFKA_POM="$ROOT/scripts/kafka/pom.xml"
KAFKA_LOG4J="$ROOT/scripts/kafka/log4j2.properties"
KAFKA_LIBS="$CACHE_DIR/kafka/libs"
KAFKA_DIR="$SERVICES_DIR/kafka"
KAFKA_DATA="$KAFKA_DIR/data"
KAFKA_PROPS="$KAFKA_DIR/server.properties"
KAFKA_ADMIN_PROPS="$KAFKA_DIR/admin.properties"
KAFKA_PID="$KAFKA_DIR/kafka.pid"
KAFKA_LOG="$KAFKA_DIR/kafka.log"
KAFKA_BOOTSTRAP="127.0.0.1:9092"
KAFKA_HEAP="${DEDUPE_KAFKA_HEAP:--Xmx512m}"

# Bounds, in seconds.
APT_UPDATE_TIMEOUT=300
APT_INSTALL_TIMEOUT=900
MVN_TIMEOUT=900
PG_START_TIMEOUT=90
RABBIT_START_TIMEOUT=120
KAFKA_START_TIMEOUT=90
KAFKA_STOP_TIMEOUT=30

export HOME="${HOME:-/root}"
export DEBIAN_FRONTEND=noninteractive
export LC_ALL="${LC_ALL:-C.UTF-8}"

log() { printf 'services: %s\n' "$*"; }
die() { printf 'services: error: %s\n' "$*" >&2; exit 1; }
trap 'printf "services: error: command failed (line %s): %s\n" "$LINENO" "$BASH_COMMAND" >&2' ERR

now() { date +%s; }

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# without_extra_fds (a daemon must not hold a caller's pipe: make's jobserver, a CI log pipe,
# our lock on fd 9) and port_open.
# shellcheck source=scripts/lib/process.sh
. "$ROOT/scripts/lib/process.sh"

# ----------------------------------------------------------------------------------------------
# Packages (installed only when missing; apt-get update at most once per run)
# ----------------------------------------------------------------------------------------------
APT_UPDATED=0
apt_install() {
  [ "$(id -u)" = 0 ] || die "need root to install $* (apt-get)"
  command -v apt-get >/dev/null || die "apt-get not found; install $* yourself"
  local apt_log="$SERVICES_DIR/apt.log"
  if [ "$APT_UPDATED" = 0 ]; then
    log "apt-get update"
    timeout "$APT_UPDATE_TIMEOUT" apt-get update -qq >"$apt_log" 2>&1 \
      || { tail -n 20 "$apt_log" >&2; die "apt-get update failed or timed out (log: $apt_log)"; }
    APT_UPDATED=1
  fi
  # The packages' scripts cannot start the services here ("policy-rc.d denied execution of
  # start"); that is expected: this script starts them.
  log "apt-get install $* (log: $apt_log)"
  timeout "$APT_INSTALL_TIMEOUT" apt-get install -y -qq --no-install-recommends "$@" >>"$apt_log" 2>&1 \
    || { tail -n 30 "$apt_log" >&2; die "apt-get install $* failed or timed out (log: $apt_log)"; }
}

pg_installed() {
  command -v pg_ctlcluster >/dev/null && [ -x "/usr/lib/postgresql/${PG_VERSION}/bin/postgres" ] \
    && command -v psql >/dev/null
}
rabbit_installed() {
  [ -x /usr/sbin/rabbitmq-server ] && [ -x /usr/sbin/rabbitmqctl ]
}
java_bin() {
  if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then echo "$JAVA_HOME/bin/java"; else command -v java || true; fi
}
java_major() {
  local j; j="$(java_bin)"; [ -n "$j" ] || { echo 0; return; }
  "$j" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.specification\.version = //p' | head -1
}

ensure_packages() {
  local want=() s
  for s in "$@"; do
    case "$s" in
      postgres) pg_installed || want+=(postgresql) ;;
      rabbitmq) rabbit_installed || want+=(rabbitmq-server) ;;
      kafka)
        local jm; jm="$(java_major)"
        [ "${jm:-0}" -ge 17 ] 2>/dev/null || want+=(openjdk-17-jdk-headless)
        command -v mvn >/dev/null || want+=(maven)
        ;;
    esac
  done
  if [ "${#want[@]}" -gt 0 ]; then
    apt_install "${want[@]}"
  fi
}

# ----------------------------------------------------------------------------------------------
# PostgreSQL
# ----------------------------------------------------------------------------------------------
pg_su() { (cd / && timeout 30 runuser -u postgres -- "$@"); }
pg_psql() { pg_su psql -X -q -v ON_ERROR_STOP=1 -p "$PG_PORT" -d postgres; }  # SQL on stdin
pg_running() { timeout 15 pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" status >/dev/null 2>&1; }
# Password login over TCP works and the role may create databases (the tests need it).
pg_login_ok() {
  local out
  out="$(PGCONNECT_TIMEOUT=5 timeout 10 psql -X -q -t -A "$PG_DSN" \
    -c 'select rolcreatedb from pg_roles where rolname = current_user' 2>/dev/null)" || return 1
  [ "$out" = t ]
}
# Start/stop/restart the cluster. Daemons must not inherit our stdout (a caller's pipe would
# never close) nor the lock on fd 9.
pg_ctl() {
  local out="$SERVICES_DIR/pg_ctlcluster.out"
  if ! (without_extra_fds timeout "$PG_START_TIMEOUT" pg_ctlcluster --skip-systemctl-redirect \
      "$PG_VERSION" "$PG_CLUSTER" "$1") >"$out" 2>&1 </dev/null; then
    cat "$out" >&2
    die "pg_ctlcluster $1 failed; see /var/log/postgresql/postgresql-${PG_VERSION}-${PG_CLUSTER}.log"
  fi
}

pg_up() {
  ensure_packages postgres
  if ! timeout 15 pg_lsclusters -h 2>/dev/null | awk -v v="$PG_VERSION" -v c="$PG_CLUSTER" '$1==v && $2==c {f=1} END {exit !f}'; then
    log "postgres: creating cluster ${PG_VERSION}/${PG_CLUSTER}"
    timeout 120 pg_createcluster "$PG_VERSION" "$PG_CLUSTER" >/dev/null || die "pg_createcluster failed"
  fi

  local conf_dir="/etc/postgresql/${PG_VERSION}/${PG_CLUSTER}"
  local port; port="$(timeout 15 pg_lsclusters -h | awk -v v="$PG_VERSION" -v c="$PG_CLUSTER" '$1==v && $2==c {print $3}')"
  local restart=0
  if [ "$port" != "$PG_PORT" ]; then
    log "postgres: cluster port is $port, setting $PG_PORT"
    timeout 15 pg_conftool "$PG_VERSION" "$PG_CLUSTER" set port "$PG_PORT"
    restart=1
  fi
  # Harmless test tuning only (fsync / synchronous_commit stay on). Debian's postgresql.conf
  # includes conf.d/ last, so these win.
  local dropin
  dropin="# Written by dedupe-worker scripts/services.sh: local test rig settings.
listen_addresses = '127.0.0.1'
max_connections = 200"
  if ! grep -q "^include_dir = 'conf.d'" "$conf_dir/postgresql.conf"; then
    die "$conf_dir/postgresql.conf has no include_dir = 'conf.d'; cannot apply $PG_CONF_DROPIN"
  fi
  if [ "$(cat "$PG_CONF_DROPIN" 2>/dev/null)" != "$dropin" ]; then
    log "postgres: writing $PG_CONF_DROPIN (listen 127.0.0.1, max_connections=200)"
    mkdir -p "$(dirname "$PG_CONF_DROPIN")"
    printf '%s\n' "$dropin" >"$PG_CONF_DROPIN"
    restart=1
  fi
  # Password login over TCP from 127.0.0.1 (Debian's default pg_hba.conf already has it).
  local hba="$conf_dir/pg_hba.conf" reload=0
  if ! grep -Eq '^[[:space:]]*host[[:space:]]+all[[:space:]]+(all|dedupe)[[:space:]]+127\.0\.0\.1/32[[:space:]]+(scram-sha-256|md5)' "$hba"; then
    log "postgres: adding a password rule for 127.0.0.1 to $hba"
    sed -i '1i host    all    dedupe    127.0.0.1/32    scram-sha-256    # dedupe-worker' "$hba"
    reload=1
  fi

  if pg_running; then
    if [ "$restart" = 1 ]; then
      log "postgres: restarting ${PG_VERSION}/${PG_CLUSTER} to apply settings"
      pg_ctl restart
    elif [ "$reload" = 1 ]; then
      pg_ctl reload
    fi
  else
    log "postgres: starting cluster ${PG_VERSION}/${PG_CLUSTER}"
    pg_ctl start
  fi

  if pg_login_ok; then
    log "postgres: up ($PG_DSN)"
    return 0
  fi
  log "postgres: ensuring role dedupe (LOGIN CREATEDB) and database dedupe"
  pg_psql <<'SQL' >/dev/null || die "could not create role/database dedupe"
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'dedupe') THEN
    CREATE ROLE dedupe LOGIN CREATEDB PASSWORD 'dedupe';
  ELSE
    ALTER ROLE dedupe LOGIN CREATEDB PASSWORD 'dedupe';
  END IF;
END
$$;
SELECT 'CREATE DATABASE dedupe OWNER dedupe'
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'dedupe') \gexec
SQL
  pg_login_ok || die "psql $PG_DSN -c 'select 1' fails after setup"
  log "postgres: up ($PG_DSN)"
}

pg_down() {
  if ! pg_installed || ! pg_running; then log "postgres: already stopped"; return 0; fi
  log "postgres: stopping cluster ${PG_VERSION}/${PG_CLUSTER}"
  pg_ctl stop
}

pg_status() { pg_installed && pg_running && pg_login_ok; }

# ----------------------------------------------------------------------------------------------
# RabbitMQ (the Debian wrappers in /usr/sbin run everything as the rabbitmq user, whose
# HOME /var/lib/rabbitmq holds the Erlang cookie)
# ----------------------------------------------------------------------------------------------
rabbit_ping() { (cd / && timeout 20 rabbitmq-diagnostics -q ping -t 10 >/dev/null 2>&1); }

# A real AMQP 0-9-1 exchange: send the protocol header, expect a method frame (Connection.Start).
amqp_ok() {
  # shellcheck disable=SC2016  # the inner script is expanded by the inner bash
  timeout 5 bash -c '
    exec 3<>/dev/tcp/127.0.0.1/5672 || exit 1
    printf "AMQP\x00\x00\x09\x01" >&3
    b=$(head -c 1 <&3 | od -An -tx1 | tr -d " \n")
    [ "$b" = "01" ]' 2>/dev/null
}

rabbit_guest_ok() { (cd / && timeout 20 rabbitmqctl -q authenticate_user guest guest >/dev/null 2>&1); }

rabbit_cookie() {
  # The cookie lives with the rabbitmq user; give root the same one if root has none, so that
  # Erlang tools run directly as root (not through the wrappers) can talk to the node too.
  local rc=/var/lib/rabbitmq/.erlang.cookie
  if [ -f "$rc" ]; then
    chown rabbitmq:rabbitmq "$rc" 2>/dev/null || true
    chmod 400 "$rc"
    if [ "$(id -u)" = 0 ] && [ ! -e "$HOME/.erlang.cookie" ]; then
      install -m 400 "$rc" "$HOME/.erlang.cookie"
    fi
  fi
}

# The Debian wrapper /usr/sbin/rabbitmq-server starts the node through `su`, whose PAM session
# (pam_limits) resets the open-files limit to 1024. RabbitMQ keeps a file handle per queue while
# it recovers them at boot; with more durable queues than handles (left by a developer's earlier
# runs, say) the boot stalls for good after "Recovering N queues, available file handles: 927".
# So start the node as the rabbitmq user ourselves, with the limit raised to the hard limit.
RABBIT_NOFILE="${DEDUPE_RABBIT_NOFILE:-65536}"

rabbit_start_detached() {
  case "$RABBIT_NOFILE" in '' | *[!0-9]*) die "DEDUPE_RABBIT_NOFILE must be a number" ;; esac
  if [ "$(id -u)" = 0 ]; then
    (cd / && without_extra_fds timeout -k 5 30 su rabbitmq -s /bin/sh -c \
      "ulimit -n $RABBIT_NOFILE 2>/dev/null || ulimit -n \$(ulimit -Hn); cd /var/lib/rabbitmq && /usr/lib/rabbitmq/bin/rabbitmq-server -detached")
  else
    (cd / && without_extra_fds timeout -k 5 30 rabbitmq-server -detached)
  fi
}

rabbit_log_tail() {
  local f
  f=$(ls -t /var/log/rabbitmq/rabbit@*.log 2>/dev/null | grep -v upgrade | head -n 1)
  [ -n "$f" ] || return 0
  printf 'services: last lines of %s:\n' "$f" >&2
  tail -n 15 "$f" | cut -c1-240 | sed 's/^/  /' >&2
}

rabbit_up() {
  ensure_packages rabbitmq
  mkdir -p /var/log/rabbitmq /var/lib/rabbitmq
  chown rabbitmq:rabbitmq /var/log/rabbitmq /var/lib/rabbitmq
  rabbit_cookie
  if ! rabbit_ping; then
    log "rabbitmq: starting (rabbitmq-server -detached, open files limit $RABBIT_NOFILE)"
    rabbit_start_detached >"$SERVICES_DIR/rabbitmq-start.out" 2>&1 </dev/null \
      || { cat "$SERVICES_DIR/rabbitmq-start.out" >&2; die "rabbitmq-server -detached failed"; }
    # await_startup needs the node to be reachable first; both waits are bounded.
    local deadline=$(( $(now) + RABBIT_START_TIMEOUT ))
    until rabbit_ping; do
      [ "$(now)" -lt "$deadline" ] || { rabbit_log_tail; die "rabbitmq did not come up within ${RABBIT_START_TIMEOUT}s; see /var/log/rabbitmq/"; }
      sleep 1
    done
    rabbit_cookie
  fi
  # The CLI's own timeout, not only timeout(1): killing the su wrapper would orphan the Erlang
  # CLI, which keeps our stdout open.
  if ! (cd / && timeout -k 5 $(( RABBIT_START_TIMEOUT + 10 )) \
        rabbitmqctl -q await_startup --timeout "$RABBIT_START_TIMEOUT" </dev/null >/dev/null 2>&1); then
    rabbit_log_tail
    die "rabbitmq is running but did not finish booting within ${RABBIT_START_TIMEOUT}s; see /var/log/rabbitmq/ (if it stalls while recovering queues, raise DEDUPE_RABBIT_NOFILE or delete stale queues)"
  fi
  if ! rabbit_guest_ok; then
    log "rabbitmq: (re)creating user guest/guest"
    (cd / && timeout 20 rabbitmqctl -q add_user guest guest >/dev/null 2>&1) \
      || (cd / && timeout 20 rabbitmqctl -q change_password guest guest >/dev/null)
    (cd / && timeout 20 rabbitmqctl -q set_permissions -p / guest '.*' '.*' '.*' >/dev/null)
    (cd / && timeout 20 rabbitmqctl -q set_user_tags guest administrator >/dev/null)
    rabbit_guest_ok || die "guest/guest cannot authenticate"
  fi
  local deadline=$(( $(now) + 30 ))
  until amqp_ok; do
    [ "$(now)" -lt "$deadline" ] || die "nothing speaks AMQP on 127.0.0.1:5672"
    sleep 1
  done
  log "rabbitmq: up ($AMQP_URL)"
}

rabbit_down() {
  if ! rabbit_installed || ! rabbit_ping; then log "rabbitmq: already stopped"; return 0; fi
  # `shutdown` is `stop` that also waits for the Erlang VM to exit, so an `up` right after
  # cannot race a node that is still going down.
  log "rabbitmq: stopping (rabbitmqctl shutdown)"
  (cd / && timeout -k 5 60 rabbitmqctl -q shutdown >/dev/null 2>&1) \
    || (cd / && timeout -k 5 60 rabbitmqctl -q stop >/dev/null) \
    || die "rabbitmqctl shutdown/stop failed or timed out"
}

rabbit_status() { rabbit_installed && rabbit_ping && amqp_ok; }

# ----------------------------------------------------------------------------------------------
# Kafka
# ----------------------------------------------------------------------------------------------
kafka_version() { sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$KAFKA_POM" | head -1; }
kafka_marker_text() { printf 'kafka=%s pom-sha256=%s\n' "$(kafka_version)" "$(sha256sum "$KAFKA_POM" | cut -d' ' -f1)"; }
kafka_tool() {  # kafka_tool <timeout-s> <main-class> args...
  local t="$1"; shift
  timeout "$t" "$(java_bin)" -Xmx256m -Dorg.apache.logging.log4j.level=WARN \
    -cp "$KAFKA_LIBS/*" "$@"
}

kafka_fetch() {
  local marker="$KAFKA_LIBS/.fetched" want
  want="$(kafka_marker_text)"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
    return 0
  fi
  log "kafka: fetching jars for Kafka $(kafka_version) with Maven into $KAFKA_LIBS"
  local t0; t0="$(now)"
  local tmp="$KAFKA_LIBS.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  if ! timeout "$MVN_TIMEOUT" mvn -B -q -f "$KAFKA_POM" dependency:copy-dependencies \
        -DoutputDirectory="$tmp" >"$tmp.mvn.log" 2>&1; then
    tail -n 30 "$tmp.mvn.log" >&2 || true
    rm -rf "$tmp" "$tmp.mvn.log"
    die "Maven could not fetch the Kafka jars (or timed out after ${MVN_TIMEOUT}s)"
  fi
  rm -f "$tmp.mvn.log"
  ls "$tmp"/kafka_2.13-*.jar >/dev/null 2>&1 || { rm -rf "$tmp"; die "Maven fetched no kafka_2.13 jar"; }
  printf '%s\n' "$want" >"$tmp/.fetched"
  rm -rf "$KAFKA_LIBS"
  mv "$tmp" "$KAFKA_LIBS"
  log "kafka: fetched $(find "$KAFKA_LIBS" -name '*.jar' | wc -l) jars in $(( $(now) - t0 ))s"
}

kafka_write_config() {
  mkdir -p "$KAFKA_DATA"
  cat >"$KAFKA_PROPS.tmp" <<EOF
# Generated by scripts/services.sh; edits are overwritten. Single-node KRaft broker+controller.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:9093
listeners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093
advertised.listeners=PLAINTEXT://127.0.0.1:9092
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$KAFKA_DATA
num.partitions=4
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
EOF
  mv "$KAFKA_PROPS.tmp" "$KAFKA_PROPS"
  kafka_write_admin_config
}

kafka_write_admin_config() {
  mkdir -p "$KAFKA_DIR"
  cat >"$KAFKA_ADMIN_PROPS" <<'EOF'
# Client settings for the health check: fail fast instead of retrying for a minute.
request.timeout.ms=5000
default.api.timeout.ms=8000
socket.connection.setup.timeout.ms=2000
socket.connection.setup.timeout.max.ms=2000
EOF
}

# The pid of our broker, if it is alive (pid file first, else a java process started with our
# server.properties).
kafka_pid() {
  local pid
  if [ -f "$KAFKA_PID" ]; then
    pid="$(cat "$KAFKA_PID" 2>/dev/null || true)"
    if [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] \
        && [[ "$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" == *" kafka.Kafka "* ]]; then
      echo "$pid"; return 0
    fi
  fi
  local d c
  for d in /proc/[0-9]*; do
    c="$(tr '\0' ' ' 2>/dev/null <"$d/cmdline")" || continue
    if [[ "$c" == *" kafka.Kafka $KAFKA_PROPS "* ]]; then
      echo "${d#/proc/}"; return 0
    fi
  done
  return 1
}

# The broker answers a metadata request (not just a TCP connect).
kafka_healthy() {
  port_open 9092 || return 1
  [ -f "$KAFKA_LIBS/.fetched" ] || return 1
  [ -f "$KAFKA_ADMIN_PROPS" ] || kafka_write_admin_config
  kafka_tool 25 org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" \
    --command-config "$KAFKA_ADMIN_PROPS" --list >/dev/null 2>&1
}

kafka_up() {
  ensure_packages kafka
  local jm; jm="$(java_major)"
  [ "${jm:-0}" -ge 17 ] 2>/dev/null || die "Kafka 4 needs Java 17+, found '${jm}' ($(java_bin)); set JAVA_HOME"
  mkdir -p "$KAFKA_DIR"
  kafka_fetch
  if kafka_pid >/dev/null && kafka_healthy; then
    log "kafka: up ($KAFKA_BOOTSTRAP, Kafka $(kafka_version))"
    return 0
  fi
  local pid
  if pid="$(kafka_pid)"; then
    log "kafka: broker process $pid exists but is not answering yet; waiting"
  else
    if port_open 9092 || port_open 9093; then
      die "127.0.0.1:9092 or :9093 is taken by a process that is not this repo's broker (see: ss -ltnp)"
    fi
    kafka_write_config
    if [ ! -f "$KAFKA_DATA/meta.properties" ]; then
      local cid
      cid="$(kafka_tool 60 kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)" || true
      [[ "$cid" =~ ^[A-Za-z0-9_-]{22}$ ]] || die "kafka: could not generate a cluster id (got '$cid')"
      log "kafka: formatting $KAFKA_DATA (cluster id $cid)"
      kafka_tool 60 -Dlog4j2.configurationFile="$KAFKA_LOG4J" kafka.tools.StorageTool format \
        --standalone -t "$cid" -c "$KAFKA_PROPS" >"$KAFKA_DIR/format.log" 2>&1 \
        || { tail -n 20 "$KAFKA_DIR/format.log" >&2; die "kafka storage format failed"; }
    fi
    log "kafka: starting broker (log: $KAFKA_LOG)"
    # setsid: the broker gets its own session, so it outlives this script and its caller's
    # terminal or process group.
    # shellcheck disable=SC2086  # KAFKA_HEAP may hold several JVM options
    (without_extra_fds nohup setsid "$(java_bin)" $KAFKA_HEAP -Xms256m -XX:+UseG1GC \
      -Djava.awt.headless=true -Dlog4j2.configurationFile="$KAFKA_LOG4J" \
      -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_PROPS") >>"$KAFKA_LOG" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$KAFKA_PID"
  fi
  local t0 deadline
  t0="$(now)"; deadline=$(( t0 + KAFKA_START_TIMEOUT ))
  until kafka_healthy; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$KAFKA_LOG" >&2 || true
      rm -f "$KAFKA_PID"
      die "kafka broker exited during startup; see $KAFKA_LOG"
    fi
    if [ "$(now)" -ge "$deadline" ]; then
      tail -n 30 "$KAFKA_LOG" >&2 || true
      die "kafka did not answer a metadata request on $KAFKA_BOOTSTRAP within ${KAFKA_START_TIMEOUT}s (pid $pid still running; see $KAFKA_LOG)"
    fi
    sleep 1
  done
  log "kafka: up ($KAFKA_BOOTSTRAP, Kafka $(kafka_version), ready in $(( $(now) - t0 ))s)"
}

kafka_down() {
  local pid
  if ! pid="$(kafka_pid)"; then
    rm -f "$KAFKA_PID"
    log "kafka: already stopped"
    return 0
  fi
  log "kafka: stopping broker (pid $pid)"
  kill "$pid" 2>/dev/null || true
  local deadline=$(( $(now) + KAFKA_STOP_TIMEOUT ))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(now)" -ge "$deadline" ]; then
      log "kafka: not stopped after ${KAFKA_STOP_TIMEOUT}s, sending SIGKILL"
      kill -9 "$pid" 2>/dev/null || true
      local d2=$(( $(now) + 10 ))
      while kill -0 "$pid" 2>/dev/null; do
        [ "$(now)" -lt "$d2" ] || die "kafka pid $pid survives SIGKILL"
        sleep 0.2
      done
      break
    fi
    sleep 0.2
  done
  rm -f "$KAFKA_PID"
}

kafka_status() { kafka_pid >/dev/null && kafka_healthy; }

# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------
cmd=up
case "${1:-}" in
  up|down|status) cmd="$1"; shift ;;
  -h|--help|help) usage; exit 0 ;;
esac

services=()
for a in "$@"; do
  case "$a" in
    postgres|postgresql|pg) services+=(postgres) ;;
    rabbitmq|rabbit|amqp) services+=(rabbitmq) ;;
    kafka) services+=(kafka) ;;
    *) usage >&2; die "unknown command or service: $a" ;;
  esac
done
[ "${#services[@]}" -gt 0 ] || services=(postgres rabbitmq kafka)

mkdir -p "$SERVICES_DIR"
# One run at a time (e.g. two `make test` in parallel); bounded wait for the lock.
exec 9>"$SERVICES_DIR/.lock"
flock -w 600 9 || die "another scripts/services.sh is still running (waited 600s for $SERVICES_DIR/.lock)"

case "$cmd" in
  up)
    t_all="$(now)"
    [ "$(id -u)" = 0 ] || log "warning: not root; installing packages and starting PostgreSQL/RabbitMQ need root"
    # Install everything missing in one apt-get run (one update) before starting anything.
    ensure_packages "${services[@]}"
    for s in "${services[@]}"; do
      case "$s" in
        postgres) pg_up ;;
        rabbitmq) rabbit_up ;;
        kafka) kafka_up ;;
      esac
    done
    log "all up: ${services[*]} ($(( $(now) - t_all ))s)"
    ;;
  down)
    # Reverse order: Kafka first, the database last.
    for (( i=${#services[@]}-1; i>=0; i-- )); do
      case "${services[$i]}" in
        postgres) pg_down ;;
        rabbitmq) rabbit_down ;;
        kafka) kafka_down ;;
      esac
    done
    log "down: ${services[*]}"
    ;;
  status)
    rc=0
    for s in "${services[@]}"; do
      case "$s" in
        postgres) if pg_status; then log "postgres up   $PG_DSN"; else log "postgres down"; rc=1; fi ;;
        rabbitmq) if rabbit_status; then log "rabbitmq up   $AMQP_URL"; else log "rabbitmq down"; rc=1; fi ;;
        kafka) if kafka_status; then log "kafka    up   $KAFKA_BOOTSTRAP"; else log "kafka    down"; rc=1; fi ;;
      esac
    done
    exit "$rc"
    ;;
esac
