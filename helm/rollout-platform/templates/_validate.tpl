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
{{- if and .Values.auth.required (not (include "rollout.hasSecret" .)) -}}
  {{- fail "auth.required is true but no API key or sync token is configured: secrets.existingSecret must name a Secret when secrets.create is false (or set secrets.create: true, with secrets.apiKey/secrets.syncToken or random ones; auth.required: false runs the API without authentication)" -}}
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
{{- end -}}
