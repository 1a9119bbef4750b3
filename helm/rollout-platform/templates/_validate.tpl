{{/*
Cross-field rules JSON Schema cannot express; values.schema.json handles the rest
(types, ranges, unknown keys). Messages name the offending value by its path.
*/}}
{{- define "rollout.validate" -}}
{{- $tp := include "rollout.tp" . | int -}}
{{- $gpus := include "rollout.gpusPerPod" . | int -}}
{{- if include "rollout.cpuOnly" . -}}
  {{- if and (not (kindIs "invalid" .Values.worker.gpusPerPod)) (gt (.Values.worker.gpusPerPod | int) 0) -}}
    {{- fail (printf "worker.gpusPerPod (%d) must be unset or 0 when platform.model.device is cpu" (.Values.worker.gpusPerPod | int)) -}}
  {{- end -}}
{{- else if lt $gpus $tp -}}
  {{- fail (printf "platform.model.tensor_parallel_size (%d) must be <= worker.gpusPerPod (%d): a replica's tensor-parallel workers share one pod" $tp $gpus) -}}
{{- end -}}
{{- $a := (.Values.platform.deployment | default dict).autoscaling -}}
{{- if kindIs "map" $a -}}
  {{- $b := include "rollout.replicaBounds" . | fromJson -}}
  {{- if gt (int $b.min) (int $b.max) -}}
    {{- fail (printf "platform.deployment.autoscaling.min_replicas (%d) must be <= platform.deployment.autoscaling.max_replicas (%d)" (int $b.min) (int $b.max)) -}}
  {{- end -}}
  {{- $look := ternary $a.look_back_period_s 30.0 (hasKey $a "look_back_period_s") | float64 -}}
  {{- range $field, $default := dict "upscale_delay_s" 30.0 "downscale_delay_s" 300.0 -}}
    {{- $v := ternary (get $a $field) $default (hasKey $a $field) | float64 -}}
    {{- if lt $v $look -}}
      {{- fail (printf "platform.deployment.autoscaling.%s (%v) must be >= platform.deployment.autoscaling.look_back_period_s (%v)" $field $v $look) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- $cc := .Values.compileCache -}}
{{- if $cc.enabled -}}
  {{- if and (eq $cc.source "modelCache") (or (not .Values.modelCache.enabled) .Values.modelCache.readOnly) -}}
    {{- fail "compileCache.source is modelCache but the model cache is not mounted read-write: set modelCache.enabled: true and modelCache.readOnly: false, or another compileCache.source (emptyDir, existingClaim)" -}}
  {{- end -}}
  {{- if and (eq $cc.source "existingClaim") (not $cc.existingClaim) -}}
    {{- fail "compileCache.source is existingClaim but compileCache.existingClaim names no claim" -}}
  {{- end -}}
  {{- if and .Values.modelCache.enabled (eq (clean $cc.mountPath) (clean .Values.modelCache.mountPath)) -}}
    {{- fail (printf "compileCache.mountPath (%s) must differ from modelCache.mountPath" $cc.mountPath) -}}
  {{- end -}}
{{- end -}}
{{- if and .Values.auth.required (not (include "rollout.hasSecret" .)) -}}
  {{- fail "auth.required is true but no API key or sync token is configured: secrets.existingSecret must name a Secret when secrets.create is false (or set secrets.create: true, with secrets.apiKey/secrets.syncToken or random ones; auth.required: false runs the API without authentication)" -}}
{{- end -}}
{{- if .Values.rayAuth.enabled -}}
  {{- if not (include "rollout.hasSecret" .) -}}
    {{- fail "rayAuth.enabled is true but there is no Secret to hold Ray's token: set secrets.create: true, or secrets.existingSecret to a Secret with the key auth_token (or rayAuth.enabled: false)" -}}
  {{- end -}}
  {{- if semverCompare "<2.52.0-0" .Values.rayVersion -}}
    {{- fail (printf "rayAuth.enabled needs Ray 2.52 or newer (rayVersion is %s): set rayAuth.enabled: false for older Ray" .Values.rayVersion) -}}
  {{- end -}}
  {{- if and .Values.rayAuth.token (lt (len .Values.rayAuth.token) 32) -}}
    {{- fail (printf "rayAuth.token must be at least 32 characters (got %d); leave it empty for a random one" (len .Values.rayAuth.token)) -}}
  {{- end -}}
{{- end -}}
{{- if include "rollout.toolsEnabled" . -}}
  {{- $t := .Values.toolWorkers -}}
  {{- if or (gt (int $t.minReplicas) (int $t.replicas)) (gt (int $t.replicas) (int $t.maxReplicas)) -}}
    {{- fail (printf "toolWorkers.replicas (%d) must be within toolWorkers.minReplicas (%d) and toolWorkers.maxReplicas (%d)" (int $t.replicas) (int $t.minReplicas) (int $t.maxReplicas)) -}}
  {{- end -}}
  {{- if gt (int .Values.rayPorts.minWorker) (int .Values.rayPorts.maxWorker) -}}
    {{- fail (printf "rayPorts.minWorker (%d) must be <= rayPorts.maxWorker (%d)" (int .Values.rayPorts.minWorker) (int .Values.rayPorts.maxWorker)) -}}
  {{- end -}}
  {{- /* The chart sets these itself: an override would break tool placement or the NetworkPolicy. */ -}}
  {{- range $group := list "head" "worker" "toolWorkers" -}}
    {{- range $key := list "resources" "node-manager-port" "object-manager-port" "min-worker-port" "max-worker-port" "num-cpus" -}}
      {{- if and (hasKey (get $.Values $group).rayStartParams $key) (or (ne $key "num-cpus") (eq $group "toolWorkers")) -}}
        {{- fail (printf "%s.rayStartParams.%s is set by the chart while toolWorkers.enabled is true (custom resources place tool actors and keep the ingress off tool pods; rayPorts feeds the tool NetworkPolicy)" $group $key) -}}
      {{- end -}}
    {{- end -}}
  {{- end -}}
  {{- $wr := ((.Values.platform.tools | default dict).worker_resource) -}}
  {{- if and $wr (ne $wr $t.resource) -}}
    {{- fail (printf "platform.tools.worker_resource (%s) must be unset or toolWorkers.resource (%s) while toolWorkers.enabled is true: the chart sets it" $wr $t.resource) -}}
  {{- end -}}
  {{- $d := .Values.platform.deployment | default dict -}}
  {{- if and (include "rollout.cpuOnly" .) (hasKey $d "num_cpus") (eq (float64 $d.num_cpus) 0.0) -}}
    {{- fail "platform.deployment.num_cpus must be > 0 on cpu while toolWorkers.enabled is true: an engine replica taking no CPU and no GPU could be placed on a tool worker" -}}
  {{- end -}}
{{- end -}}
{{- if and .Values.modelCache.enabled (not .Values.modelCache.existingClaim) (not .Values.modelCache.size) -}}
  {{- fail "modelCache.size must be set when modelCache.existingClaim is empty" -}}
{{- end -}}
{{- include "rollout.validateMonitoringAPIs" . -}}
{{- end -}}

{{/*
The ServiceMonitor and PrometheusRule are kinds of the Prometheus operator's CRDs: on a cluster
without them `helm install` fails half-way with `no matches for kind "PrometheusRule"`. Fail
before anything is created instead, naming the values that turn them off. Helm fills
.Capabilities.APIVersions from the cluster on install/upgrade; `helm template` knows only the
built-in kinds, so GitOps renders pass `--api-versions` or set monitoring.assumeCRDs.
*/}}
{{- define "rollout.validateMonitoringAPIs" -}}
{{- if not .Values.monitoring.assumeCRDs -}}
  {{- $kinds := include "rollout.monitoringKinds" . | fromJson -}}
  {{- $missing := list -}}
  {{- $off := list -}}
  {{- range $api := keys $kinds | sortAlpha -}}
    {{- if not ($.Capabilities.APIVersions.Has $api) -}}
      {{- $missing = append $missing $api -}}
      {{- $off = append $off (printf "%s=false" (get $kinds $api)) -}}
    {{- end -}}
  {{- end -}}
  {{- if $missing -}}
    {{- fail (printf "the cluster does not serve %s (the Prometheus operator's CRDs are not installed): install the Prometheus operator (e.g. kube-prometheus-stack) first, or set %s. To render them anyway where Helm cannot ask the cluster (helm template for GitOps), pass --api-versions %s, or set monitoring.assumeCRDs=true" (join " or " $missing) (join " and " $off) (join " --api-versions " $missing)) -}}
  {{- end -}}
{{- end -}}
{{- end -}}
